# Installs torchrpc so that another CMake project can use it with
#
#   find_package(torchrpc REQUIRED)
#   target_link_libraries(app PRIVATE torchrpc::torchrpc)
#
# Included at the end of the top-level CMakeLists.txt, after every target
# exists. Layout under the prefix:
#
#   include/torchrpc/torchrpc.h           the umbrella header
#   include/torchrpc/<layer>/*.h          public headers of each layer
#                                         (<layer>/detail/ is private: not installed)
#   lib/libtorchrpc_<layer>.so
#   lib/cmake/torchrpc/torchrpcConfig.cmake, ...ConfigVersion.cmake,
#                      torchrpcTargets.cmake
#   bin/torchrpc-launch                   the native launcher (tools/launcher/)
#   bin/torchrpc-trace-merge              merges workers' traces (tools/trace/)
#
# Users write #include <torchrpc/torchrpc.h>; inside, headers include each
# other as "torchrpc/rpc/errors.h", so every target carries include/.
#
# TORCHRPC_LAYER_TARGETS lists one library target per layer folder, made by
# torchrpc_add_layer() (cmake/TorchrpcLayer.cmake), which also records each
# layer's explicit list of public headers: only those are installed.
# Each is exported as torchrpc::<folder> (the same name as its alias in the
# build tree), the umbrella `torchrpc` as torchrpc::torchrpc.

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

if(NOT DEFINED TORCHRPC_LAYER_TARGETS)
  set(TORCHRPC_LAYER_TARGETS torchrpc_rpc)
endif()

set(TORCHRPC_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/torchrpc")

foreach(layerTarget IN LISTS TORCHRPC_LAYER_TARGETS)
  if(NOT TARGET ${layerTarget})
    message(FATAL_ERROR
      "TORCHRPC_LAYER_TARGETS names ${layerTarget}, which is not a target")
  endif()
  string(REGEX REPLACE "^torchrpc_" "" layer "${layerTarget}")
  if(layer STREQUAL layerTarget OR
     NOT IS_DIRECTORY "${PROJECT_SOURCE_DIR}/${layer}")
    message(FATAL_ERROR
      "Layer target ${layerTarget} must be named torchrpc_<folder> after its "
      "source folder")
  endif()
  set_target_properties(${layerTarget} PROPERTIES EXPORT_NAME ${layer})
  # Installed layers find each other (librref -> librpc) wherever the prefix
  # is, even when the consumer's linker dropped the indirect one (--as-needed).
  get_target_property(installRpath ${layerTarget} INSTALL_RPATH)
  if(NOT installRpath)
    set_target_properties(${layerTarget} PROPERTIES INSTALL_RPATH "$ORIGIN")
  endif()
  get_target_property(publicHeaders ${layerTarget} TORCHRPC_PUBLIC_HEADERS)
  if(NOT publicHeaders)
    message(FATAL_ERROR
      "${layerTarget} lists no public headers (torchrpc_add_layer PUBLIC_HEADERS)")
  endif()
  foreach(header IN LISTS publicHeaders)
    get_filename_component(headerDir "${header}" DIRECTORY)
    install(
      FILES "${PROJECT_SOURCE_DIR}/${layer}/${header}"
      DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/torchrpc/${layer}/${headerDir}")
  endforeach()
endforeach()

set_target_properties(torchrpc PROPERTIES EXPORT_NAME torchrpc)
# Our headers need C++17; say so to consumers rather than leave them to guess
# (libtorch's own target only asks for C++14).
target_compile_features(torchrpc INTERFACE cxx_std_17)

install(
  TARGETS ${TORCHRPC_LAYER_TARGETS} torchrpc
  EXPORT torchrpcTargets
  LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
  ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
  RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")

# Not exported: a program, not something to link.
if(TARGET torchrpc-launch)
  install(TARGETS torchrpc-launch RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
endif()
if(TARGET torchrpc-trace-merge)
  install(TARGETS torchrpc-trace-merge
    RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
endif()

install(
  FILES "${PROJECT_SOURCE_DIR}/torchrpc.h"
  DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/torchrpc")

install(
  EXPORT torchrpcTargets
  NAMESPACE torchrpc::
  FILE torchrpcTargets.cmake
  DESTINATION "${TORCHRPC_INSTALL_CMAKEDIR}")

# With shared libraries (the default) TensorPipe, protobuf, Boost and OpenSSL
# are PRIVATE link dependencies hidden inside libtorchrpc_*.so, and consumers
# need only Torch and Threads. Static archives carry them as
# $<LINK_ONLY:...> entries, so then the config must find them as well; these
# variables tell it which ones this build used.
if(BUILD_SHARED_LIBS)
  set(TORCHRPC_STATIC_DEPENDENCIES OFF)
else()
  set(TORCHRPC_STATIC_DEPENDENCIES ON)
endif()
set(TORCHRPC_BOOST_COMPONENTS "")
foreach(component IN ITEMS system thread filesystem program_options)
  if(TARGET Boost::${component})
    list(APPEND TORCHRPC_BOOST_COMPONENTS ${component})
  endif()
endforeach()
if(TARGET OpenSSL::Crypto OR TARGET OpenSSL::SSL)
  set(TORCHRPC_USES_OPENSSL ON)
else()
  set(TORCHRPC_USES_OPENSSL OFF)
endif()

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/torchrpcConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/torchrpcConfig.cmake"
  INSTALL_DESTINATION "${TORCHRPC_INSTALL_CMAKEDIR}")
# 0.x: a minor version may break the API.
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/torchrpcConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMinorVersion)

install(
  FILES
    "${PROJECT_BINARY_DIR}/torchrpcConfig.cmake"
    "${PROJECT_BINARY_DIR}/torchrpcConfigVersion.cmake"
    # Static builds: the config finds TensorPipe with the same module.
    "${PROJECT_SOURCE_DIR}/cmake/FindTensorpipe.cmake"
  DESTINATION "${TORCHRPC_INSTALL_CMAKEDIR}")
