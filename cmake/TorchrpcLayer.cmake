# torchrpc_add_layer(): one library target per layer folder, declared the same
# short way for every layer.
#
#   torchrpc_add_layer(rref
#     DEPENDS rpc                      # the layer right below (PUBLIC link)
#     PROTO proto/rref/rref.proto      # optional; generated into the build tree
#     PUBLIC_HEADERS rref.h rref_context.h ...
#     SOURCES rref_context.cpp ...
#     PRIVATE_LINK protobuf::libprotobuf)
#
# What it makes:
# - target torchrpc_<layer> (alias torchrpc::<layer>), sources relative to the
#   layer's folder;
# - headers included as "torchrpc/<layer>/..." in the build tree (through the
#   build tree's include/torchrpc link) and once installed (include/), so a
#   consumer's own rpc/ or autograd/ folder can never be picked up instead;
# - generated protobuf code as "proto/<layer>/<name>.pb.h", private to the
#   layer (PROJECT_BINARY_DIR on its private include path);
# - the explicit list of public headers, which cmake/Install.cmake installs
#   and cmake/CheckLayers.cmake checks. Everything else of the layer is
#   private: detail/, engine internals, transports' insides.
#
# Layers must be added bottom-up: the order of the calls is the layering that
# Build.IncludesPointDown enforces (a layer may include only layers added
# before it, and only their public headers).

function(torchrpc_add_layer layer)
  cmake_parse_arguments(PARSE_ARGV 1 arg
    "" "" "PROTO;DEPENDS;PUBLIC_HEADERS;SOURCES;PRIVATE_LINK")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR
      "torchrpc_add_layer(${layer}): unknown arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  set(target torchrpc_${layer})
  set(dir "${PROJECT_SOURCE_DIR}/${layer}")

  set(generated "")
  foreach(proto IN LISTS arg_PROTO)
    get_filename_component(protoName "${proto}" NAME_WE)
    get_filename_component(protoDir "${proto}" DIRECTORY)
    set(protoOutputs
      "${PROJECT_BINARY_DIR}/${protoDir}/${protoName}.pb.cc"
      "${PROJECT_BINARY_DIR}/${protoDir}/${protoName}.pb.h")
    list(APPEND generated ${protoOutputs})
    add_custom_command(
      OUTPUT ${protoOutputs}
      COMMAND protobuf::protoc
        --proto_path=${PROJECT_SOURCE_DIR} --cpp_out=${PROJECT_BINARY_DIR}
        "${PROJECT_SOURCE_DIR}/${proto}"
      DEPENDS "${PROJECT_SOURCE_DIR}/${proto}" protobuf::protoc
      COMMENT "Generating ${layer}'s messages from ${proto}"
      VERBATIM)
  endforeach()

  set(sources "")
  foreach(source IN LISTS arg_SOURCES)
    list(APPEND sources "${dir}/${source}")
  endforeach()
  set(headers "")
  foreach(header IN LISTS arg_PUBLIC_HEADERS)
    if(NOT EXISTS "${dir}/${header}")
      message(FATAL_ERROR
        "torchrpc_add_layer(${layer}): public header ${header} does not exist")
    endif()
    list(APPEND headers "${header}")
  endforeach()

  add_library(${target} ${generated} ${sources})
  add_library(torchrpc::${layer} ALIAS ${target})
  torchrpc_target_defaults(${target})
  target_include_directories(${target}
    PUBLIC
      $<BUILD_INTERFACE:${TORCHRPC_BUILD_INCLUDE_DIR}>
      $<INSTALL_INTERFACE:include>
    PRIVATE
      $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}>)
  set(lowerTargets "")
  foreach(lower IN LISTS arg_DEPENDS)
    list(APPEND lowerTargets torchrpc_${lower})
  endforeach()
  target_link_libraries(${target} PUBLIC ${lowerTargets} PRIVATE ${arg_PRIVATE_LINK})
  set_target_properties(${target} PROPERTIES
    TORCHRPC_LAYER "${layer}"
    TORCHRPC_PUBLIC_HEADERS "${headers}")

  set_property(GLOBAL APPEND PROPERTY TORCHRPC_LAYERS "${layer}")
endfunction()

# The layers added so far, bottom-up, and their targets.
function(torchrpc_layers outLayers outTargets)
  get_property(layers GLOBAL PROPERTY TORCHRPC_LAYERS)
  set(targets "")
  foreach(layer IN LISTS layers)
    list(APPEND targets torchrpc_${layer})
  endforeach()
  set(${outLayers} "${layers}" PARENT_SCOPE)
  set(${outTargets} "${targets}" PARENT_SCOPE)
endfunction()
