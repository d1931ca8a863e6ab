# Finds TensorPipe. Debian's libtensorpipe-dev ships only an export file that
# hard-codes a "NONE" configuration and no package config, so we locate the
# header and the library ourselves and expose them as Tensorpipe::tensorpipe.
#
# Sets Tensorpipe_FOUND, Tensorpipe_INCLUDE_DIR, Tensorpipe_LIBRARY.
find_path(Tensorpipe_INCLUDE_DIR NAMES tensorpipe/tensorpipe.h)
find_library(Tensorpipe_LIBRARY NAMES tensorpipe)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(
  Tensorpipe REQUIRED_VARS Tensorpipe_LIBRARY Tensorpipe_INCLUDE_DIR)

if(Tensorpipe_FOUND AND NOT TARGET Tensorpipe::tensorpipe)
  add_library(Tensorpipe::tensorpipe UNKNOWN IMPORTED)
  set_target_properties(Tensorpipe::tensorpipe PROPERTIES
    IMPORTED_LOCATION "${Tensorpipe_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${Tensorpipe_INCLUDE_DIR}")
endif()
mark_as_advanced(Tensorpipe_INCLUDE_DIR Tensorpipe_LIBRARY)
