# Warnings for netio3's own targets only (linked PRIVATE, never exported).
add_library(netio3_warnings INTERFACE)
target_compile_options(netio3_warnings INTERFACE -Wall -Wextra -Wpedantic -Wshadow
                       -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Woverloaded-virtual
                       -Wimplicit-fallthrough)
# Not -Wnull-dereference: it is computed after inlining and fires inside Boost.Asio at some
# optimisation levels (sanitizer builds), where system-header suppression does not apply.
if(NETIO3_WERROR)
  target_compile_options(netio3_warnings INTERFACE -Werror)
endif()

# NETIO3_TEST_CXX_FLAGS: compile options of the programs that only run as tests (the test
# programs and the documentation's example programs; not the library, netio3-demo or the
# tools, which keep the build type's). The release preset sets "-O1 -g1": such code
# compiles in half the time of -O2 -g, and -g1 keeps file and line in backtraces; what the
# tests check is the library, built as shipped.
set(NETIO3_TEST_CXX_FLAGS "" CACHE STRING "Extra compile options of the test and example programs")
separate_arguments(netio3_test_cxx_flags UNIX_COMMAND "${NETIO3_TEST_CXX_FLAGS}")
add_library(netio3_test_flags INTERFACE)
target_compile_options(netio3_test_flags INTERFACE ${netio3_test_cxx_flags})

if(NETIO3_SANITIZER STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer
                      -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(NETIO3_SANITIZER STREQUAL "thread")
  # -Wno-tsan: GCC warns that TSan does not model atomic_thread_fence, which Boost.Asio's
  # scheduler uses. netio3 never runs an io_context (its loop is the EpollEventLoop), so
  # that code is compiled but never executed.
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer -Wno-tsan)
  add_link_options(-fsanitize=thread)
elseif(NOT NETIO3_SANITIZER STREQUAL "")
  message(FATAL_ERROR "NETIO3_SANITIZER must be '', 'address' or 'thread'")
endif()
