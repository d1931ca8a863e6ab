# cmake -P script behind Packaging.ConsumerFindsInstalledTorchrpc (registered
# in consumer_test.cmake). Every step has a timeout; the first failing step
# fails the test with its output.
#
# Inputs: TORCHRPC_BUILD_DIR, CONSUMER_SOURCE_DIR, WORK_DIR, GENERATOR,
# PUBLIC_HEADERS_FILE, EXPECT_LAUNCHER (1: bin/torchrpc-launch must be there),
# CXX_COMPILER, CXX_COMPILER_LAUNCHER (may be empty), BUILD_TYPE,
# SANITIZE_FLAGS (the tree's sanitizer flags, space-separated; may be empty).
cmake_minimum_required(VERSION 3.18)

foreach(var TORCHRPC_BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR
    PUBLIC_HEADERS_FILE)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer_test.cmake: ${var} is not set")
  endif()
endforeach()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")
# Start clean: a header left over from an earlier install must not hide one
# that is no longer installed.
file(REMOVE_RECURSE "${prefix}" "${build}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(step name timeout)
  message(STATUS "consumer test: ${name}")
  execute_process(
    COMMAND ${ARGN}
    RESULT_VARIABLE result
    OUTPUT_VARIABLE output
    ERROR_VARIABLE output
    TIMEOUT ${timeout})
  if(NOT result EQUAL 0)
    message(FATAL_ERROR
      "consumer test: ${name} failed (${result}):\n${output}")
  endif()
endfunction()

step("install into ${prefix}" 60
  "${CMAKE_COMMAND}" --install "${TORCHRPC_BUILD_DIR}" --prefix "${prefix}")

# Exactly the public headers are installed (PUBLIC_HEADERS_FILE: what
# torchrpc_add_layer() recorded), plus the umbrella.
file(STRINGS "${PUBLIC_HEADERS_FILE}" expectedHeaders)
list(APPEND expectedHeaders torchrpc.h)
list(SORT expectedHeaders)
file(GLOB_RECURSE installedHeaders RELATIVE "${prefix}/include/torchrpc"
  "${prefix}/include/torchrpc/*")
list(SORT installedHeaders)
if(NOT installedHeaders STREQUAL expectedHeaders)
  message(FATAL_ERROR
    "consumer test: the installed headers are not the public ones.\n"
    "installed: ${installedHeaders}\nexpected: ${expectedHeaders}")
endif()

# The native launcher is installed with the package (when built) and runs
# from there.
if(EXPECT_LAUNCHER)
  step("installed torchrpc-launch --help" 60
    "${prefix}/bin/torchrpc-launch" --help)
endif()

set(configureArgs
  -S "${CONSUMER_SOURCE_DIR}" -B "${build}" -G "${GENERATOR}"
  "-DCMAKE_PREFIX_PATH=${prefix}"
  "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
if(SANITIZE_FLAGS)
  list(APPEND configureArgs "-DCMAKE_CXX_FLAGS=${SANITIZE_FLAGS}"
    "-DCMAKE_EXE_LINKER_FLAGS=${SANITIZE_FLAGS}")
endif()
if(CXX_COMPILER)
  list(APPEND configureArgs "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CXX_COMPILER_LAUNCHER)
  list(APPEND configureArgs "-DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_COMPILER_LAUNCHER}")
endif()
step("configure ${CONSUMER_SOURCE_DIR}" 90 "${CMAKE_COMMAND}" ${configureArgs})

step("build" 240 "${CMAKE_COMMAND}" --build "${build}" -j 1)

set(consumer "${build}/consumer")
if(NOT EXISTS "${consumer}")
  message(FATAL_ERROR "consumer test: ${consumer} was not built")
endif()
step("run ${consumer}" 60 "${consumer}")
message(STATUS "consumer test: passed")
