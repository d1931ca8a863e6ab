# SANITIZE builds every target of this project with sanitizers:
#   address            AddressSanitizer (and LeakSanitizer)
#   address,undefined  the same plus UndefinedBehaviorSanitizer, which stops
#                      at the first finding (what tools/test.sh runs the
#                      suite under)
#   thread             ThreadSanitizer
# libtorch and TensorPipe are not instrumented: TSan runs use tests/tsan.supp
# for them. UBSan's vptr check is off because libtorch does not export every
# type_info it needs.
#
# TORCHRPC_SANITIZE_FLAGS keeps the flags for what builds against this tree
# from outside (the packaging test's consumer must link the same runtimes).
if(SANITIZE STREQUAL "address")
  set(TORCHRPC_SANITIZE_FLAGS -fsanitize=address -fno-omit-frame-pointer)
elseif(SANITIZE STREQUAL "address,undefined")
  set(TORCHRPC_SANITIZE_FLAGS -fsanitize=address,undefined -fno-sanitize=vptr
    -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
elseif(SANITIZE STREQUAL "thread")
  set(TORCHRPC_SANITIZE_FLAGS -fsanitize=thread)
elseif(SANITIZE STREQUAL "")
  set(TORCHRPC_SANITIZE_FLAGS "")
else()
  message(FATAL_ERROR
    "SANITIZE must be address, address,undefined, thread or empty, not '${SANITIZE}'")
endif()
if(TORCHRPC_SANITIZE_FLAGS)
  add_compile_options(${TORCHRPC_SANITIZE_FLAGS})
  add_link_options(${TORCHRPC_SANITIZE_FLAGS})
endif()
