# Registers the packaging test: install this build into a scratch prefix, then
# configure, build and run tests/consumer against it with find_package.
# Included from tests/CMakeLists.txt:
#
#   include(consumer/consumer_test.cmake)
#
# Under SANITIZE the installed library needs the sanitizers' runtimes: the
# consumer is built with the same flags (TORCHRPC_SANITIZE_FLAGS).
set(_consumerLauncher "")
if(CMAKE_CXX_COMPILER_LAUNCHER)
  set(_consumerLauncher "${CMAKE_CXX_COMPILER_LAUNCHER}")
endif()
string(JOIN " " _consumerSanitizeFlags ${TORCHRPC_SANITIZE_FLAGS})
add_test(
  NAME Packaging.ConsumerFindsInstalledTorchrpc
  COMMAND "${CMAKE_COMMAND}"
    "-DTORCHRPC_BUILD_DIR=${PROJECT_BINARY_DIR}"
    "-DCONSUMER_SOURCE_DIR=${CMAKE_CURRENT_LIST_DIR}"
    "-DWORK_DIR=${PROJECT_BINARY_DIR}/consumer_test"
    "-DPUBLIC_HEADERS_FILE=${PROJECT_BINARY_DIR}/torchrpc_public_headers.txt"
    "-DGENERATOR=${CMAKE_GENERATOR}"
    "-DCXX_COMPILER=${CMAKE_CXX_COMPILER}"
    "-DCXX_COMPILER_LAUNCHER=${_consumerLauncher}"
    "-DBUILD_TYPE=${CMAKE_BUILD_TYPE}"
    "-DSANITIZE_FLAGS=${_consumerSanitizeFlags}"
    "-DEXPECT_LAUNCHER=$<TARGET_EXISTS:torchrpc-launch>"
    -P "${CMAKE_CURRENT_LIST_DIR}/run_consumer_test.cmake")
# Above ctest's default 300 s: compiling one file against libtorch's headers
# with a cold ccache on a loaded 2-core machine takes most of it. The steps
# have their own timeouts (60 + 90 + 240 + 60 s).
set_tests_properties(Packaging.ConsumerFindsInstalledTorchrpc PROPERTIES
  TIMEOUT 480
  LABELS packaging)
unset(_consumerLauncher)
unset(_consumerSanitizeFlags)
