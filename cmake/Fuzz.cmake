# TORCHRPC_BUILD_FUZZERS=ON builds the libFuzzer targets of tests/fuzz/ (see
# tools/fuzz.sh). libFuzzer ships with clang only, so this needs clang; the
# whole build then gets AddressSanitizer, UndefinedBehaviorSanitizer and
# libFuzzer's coverage instrumentation, which is why it lives in a build tree
# of its own (tools/fuzz.sh uses build-fuzz/) and the default build never
# sets it. UBSan does not recover: any undefined behaviour is a crash the
# fuzzer reports, with the input that caused it. Its vptr check is off: it
# needs the type_info of every polymorphic class it meets, and libtorch does
# not export some (c10::DynamicType's), so nothing would link.
if(TORCHRPC_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR
      "TORCHRPC_BUILD_FUZZERS needs clang (libFuzzer), not "
      "${CMAKE_CXX_COMPILER_ID}: configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  if(NOT SANITIZE STREQUAL "")
    message(FATAL_ERROR "TORCHRPC_BUILD_FUZZERS brings its own sanitizers; leave SANITIZE empty")
  endif()
  add_compile_options(
    -fsanitize=address,undefined,fuzzer-no-link
    -fno-sanitize=vptr
    -fno-sanitize-recover=undefined
    -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()
