# SANITIZE=address|thread builds every target of this project with that
# sanitizer. libtorch and TensorPipe are not instrumented: TSan runs use
# tests/tsan.supp for them.
if(SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address)
elseif(SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread)
  add_link_options(-fsanitize=thread)
elseif(NOT SANITIZE STREQUAL "")
  message(FATAL_ERROR "SANITIZE must be address, thread or empty, not '${SANITIZE}'")
endif()
