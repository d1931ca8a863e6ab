# The layering, checked. Two halves:
#
# 1. Run as a script (the CTest Build.IncludesPointDown):
#
#      cmake -DROOT=<source dir> -DLAYERS="rpc;rref;autograd"
#            -DPUBLIC_HEADERS_FILE=<file> -P cmake/CheckLayers.cmake
#
#    PUBLIC_HEADERS_FILE lists one "<layer>/<path>" a line: the public headers
#    torchrpc_add_layer() recorded. It fails, naming file, line and rule, when
#    - a layer's file includes a layer above its own (the order of LAYERS is
#      bottom-up: rpc < rref < autograd < nn < optim);
#    - a layer's file includes a header of another layer that is not public
#      (another layer's detail/, engine/ or transport insides);
#    - a public header, or the umbrella torchrpc.h, includes a header that is
#      not public (it would be installed without what it needs) or generated
#      protobuf code;
#    - an example includes a header that is not public;
#    - any file, tests included, includes one of our headers without the
#      torchrpc/ prefix ("rpc/agent.h"), which a consumer's own rpc/ folder
#      could shadow.
#
# 2. Included from the top-level CMakeLists.txt: torchrpc_add_layer_checks()
#    adds that test and the target torchrpc_check_headers, which compiles
#    each public header alone (twice in one file, so a missing include guard
#    shows too), with the CTest Build.PublicHeadersCompileAlone building it.

if(CMAKE_SCRIPT_MODE_FILE)
  cmake_minimum_required(VERSION 3.18)
  foreach(required IN ITEMS ROOT LAYERS PUBLIC_HEADERS_FILE)
    if(NOT DEFINED ${required})
      message(FATAL_ERROR "CheckLayers: -D${required}=... is required")
    endif()
  endforeach()
  file(STRINGS "${PUBLIC_HEADERS_FILE}" publicHeaders)
  set(layerAlternatives "")
  foreach(layer IN LISTS LAYERS)
    list(APPEND layerAlternatives "${layer}")
  endforeach()
  list(JOIN layerAlternatives "|" layerPattern)

  set(violations "")
  # Reads `file` and calls back for each quoted or angled include of ours.
  macro(scan_includes file)
    # One list element a line; ';' and brackets would split or join
    # elements, and no include needs them.
    file(READ "${ROOT}/${file}" content)
    string(REGEX REPLACE "[][;]" " " content "${content}")
    string(REPLACE "\n" ";" lines "${content}")
    set(lineNumber 0)
    set(includes "")
    foreach(line IN LISTS lines)
      math(EXPR lineNumber "${lineNumber} + 1")
      if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*[\"<]([^\">]+)[\">]")
        list(APPEND includes "${lineNumber}:${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endmacro()

  macro(flag file lineNumber text)
    list(APPEND violations "${file}:${lineNumber}: ${text}")
  endmacro()

  set(globs "${ROOT}/torchrpc.h")
  foreach(dir IN LISTS LAYERS ITEMS examples tests bench tools)
    list(APPEND globs "${ROOT}/${dir}/*.h" "${ROOT}/${dir}/*.cpp")
  endforeach()
  file(GLOB_RECURSE allFiles RELATIVE "${ROOT}" ${globs})
  foreach(file IN LISTS allFiles)
    # Deliberately broken trees that test this script.
    if(file MATCHES "^tests/cmake/fixtures/")
      continue()
    endif()
    string(REGEX MATCH "^[^/]+" top "${file}")
    set(ownRank -1)
    list(FIND LAYERS "${top}" ownRank)
    set(isPublic FALSE)
    if(file STREQUAL "torchrpc.h" OR "${file}" IN_LIST publicHeaders)
      set(isPublic TRUE)
    endif()
    scan_includes("${file}")
    foreach(entry IN LISTS includes)
      string(REGEX MATCH "^[0-9]+" lineNumber "${entry}")
      string(REGEX REPLACE "^[0-9]+:" "" included "${entry}")
      if(included MATCHES "^(${layerPattern})/")
        flag("${file}" ${lineNumber}
          "includes \"${included}\" without the torchrpc/ prefix")
        continue()
      endif()
      if(included MATCHES "^proto/" AND isPublic)
        flag("${file}" ${lineNumber}
          "public header includes generated \"${included}\"")
        continue()
      endif()
      if(NOT included MATCHES "^torchrpc/(.*)$")
        continue()
      endif()
      set(target "${CMAKE_MATCH_1}")
      string(REGEX MATCH "^[^/]+" targetLayer "${target}")
      list(FIND LAYERS "${targetLayer}" targetRank)
      if(targetRank EQUAL -1)
        if(NOT target STREQUAL "torchrpc.h")
          flag("${file}" ${lineNumber} "includes unknown \"${included}\"")
        elseif(ownRank GREATER -1)
          flag("${file}" ${lineNumber}
            "a layer includes the umbrella header torchrpc.h")
        endif()
        continue()
      endif()
      set(targetIsPublic FALSE)
      if("${target}" IN_LIST publicHeaders)
        set(targetIsPublic TRUE)
      endif()
      if(ownRank GREATER -1 AND targetRank GREATER ownRank)
        flag("${file}" ${lineNumber}
          "${top}/ includes \"${included}\" of ${targetLayer}/, a layer above it")
      elseif(ownRank GREATER -1 AND NOT targetLayer STREQUAL top
             AND NOT targetIsPublic)
        flag("${file}" ${lineNumber}
          "${top}/ includes \"${included}\", private to ${targetLayer}/")
      elseif(isPublic AND NOT targetIsPublic)
        flag("${file}" ${lineNumber}
          "public header includes private \"${included}\"")
      elseif(top STREQUAL "examples" AND NOT targetIsPublic)
        flag("${file}" ${lineNumber}
          "an example includes private \"${included}\"")
      endif()
    endforeach()
  endforeach()

  list(LENGTH violations count)
  if(count GREATER 0)
    list(JOIN violations "\n  " text)
    message(FATAL_ERROR
      "CheckLayers: ${count} include(s) break the layering "
      "(see CONTRIBUTING.md, Layers):\n  ${text}")
  endif()
  list(LENGTH allFiles fileCount)
  message(STATUS "CheckLayers: ${fileCount} files, layers ${LAYERS}: includes point down")
  return()
endif()

# Adds Build.IncludesPointDown, Build.PublicHeadersCompileAlone and the target
# torchrpc_check_headers, for the layers added so far.
function(torchrpc_add_layer_checks)
  torchrpc_layers(layers targets)
  set(lines "")
  set(checkSources "")
  foreach(layer IN LISTS layers)
    get_target_property(headers torchrpc_${layer} TORCHRPC_PUBLIC_HEADERS)
    foreach(header IN LISTS headers)
      string(APPEND lines "${layer}/${header}\n")
      string(MAKE_C_IDENTIFIER "${layer}/${header}" stem)
      set(source "${PROJECT_BINARY_DIR}/check_headers/${stem}.cpp")
      # Twice: the second include must be a no-op.
      file(CONFIGURE OUTPUT "${source}" CONTENT
        "#include \"torchrpc/${layer}/${header}\"\n#include \"torchrpc/${layer}/${header}\"\n")
      list(APPEND checkSources "${source}")
    endforeach()
  endforeach()
  set(source "${PROJECT_BINARY_DIR}/check_headers/torchrpc_h.cpp")
  file(CONFIGURE OUTPUT "${source}" CONTENT
    "#include \"torchrpc/torchrpc.h\"\n#include \"torchrpc/torchrpc.h\"\n")
  list(APPEND checkSources "${source}")
  set(listFile "${PROJECT_BINARY_DIR}/torchrpc_public_headers.txt")
  file(CONFIGURE OUTPUT "${listFile}" CONTENT "${lines}")

  add_library(torchrpc_check_headers OBJECT EXCLUDE_FROM_ALL ${checkSources})
  target_link_libraries(torchrpc_check_headers PRIVATE torchrpc)
  torchrpc_target_defaults(torchrpc_check_headers)

  add_test(
    NAME Build.IncludesPointDown
    COMMAND "${CMAKE_COMMAND}"
      "-DROOT=${PROJECT_SOURCE_DIR}"
      "-DLAYERS=${layers}"
      "-DPUBLIC_HEADERS_FILE=${listFile}"
      -P "${PROJECT_SOURCE_DIR}/cmake/CheckLayers.cmake")
  add_test(
    NAME Build.PublicHeadersCompileAlone
    COMMAND "${CMAKE_COMMAND}" --build "${PROJECT_BINARY_DIR}"
      --target torchrpc_check_headers)
  # Compiling every public header against libtorch's headers takes a while
  # with a cold ccache.
  set_tests_properties(Build.PublicHeadersCompileAlone PROPERTIES
    TIMEOUT 900 LABELS build)
  set_tests_properties(Build.IncludesPointDown PROPERTIES LABELS build)
endfunction()
