# Checks the dynamic symbol table of libnetio3.so: every exported name must belong to the
# public API (netio3::, outside the library's internal namespaces, and what the compiler
# emits for such names), and the API's entry points must be there.
#
#   cmake -DNM=nm -DLIBRARY=libnetio3.so -P check_exports.cmake
#   cmake -DSYMBOLS_FILE=list.txt -P check_exports.cmake   (one demangled name per line:
#                                                            checks the checker)
if(DEFINED SYMBOLS_FILE)
  file(STRINGS ${SYMBOLS_FILE} names)
else()
  execute_process(COMMAND ${NM} -DC --defined-only ${LIBRARY}
                  OUTPUT_VARIABLE listing RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} -DC --defined-only ${LIBRARY} failed: ${err}")
  endif()
  string(REPLACE "\n" ";" lines "${listing}")
  set(names "")
  foreach(line IN LISTS lines)
    # "<address> <type> <name>"; the name may contain spaces.
    if(line MATCHES "^[0-9a-fA-F]+ [A-Za-z] (.+)$")
      list(APPEND names "${CMAKE_MATCH_1}")
    endif()
  endforeach()
endif()

# What the compiler emits for a class or function besides the name itself.
set(prefix "^(typeinfo name for |typeinfo for |vtable for |VTT for |construction vtable for |guard variable for |non-virtual thunk to |virtual thunk to )(.*)$")
# Namespaces and classes inside netio3 that are not API.
set(internal "^netio3::(detail|asyncmsg|libfabric|ucx|test)::|::Impl(::|$)")
set(leaks "")
foreach(name IN LISTS names)
  set(bare "${name}")
  if(name MATCHES "${prefix}")
    set(bare "${CMAKE_MATCH_2}")
  endif()
  # The UCT functions the UCX tcp wire-up guard defines (src/backends/ucx/tcp_wireup_guard.cpp).
  if(bare MATCHES "^uct_iface_(open|set_am_handler|close)$")
    continue()
  endif()
  if(NOT bare MATCHES "^netio3::" OR bare MATCHES "${internal}")
    list(APPEND leaks "${name}")
  endif()
endforeach()

# Names that must be there: the factory, the loop, the exceptions' type_info, the version.
set(required
    "netio3::Netio3Backend::create("
    "netio3::EpollEventLoop::EpollEventLoop("
    "typeinfo for netio3::NetioException"
    "netio3::version()"
    "netio3::set_log_sink(")
set(missing "")
foreach(want IN LISTS required)
  set(found FALSE)
  foreach(name IN LISTS names)
    string(FIND "${name}" "${want}" at)
    if(at EQUAL 0)
      set(found TRUE)
      break()
    endif()
  endforeach()
  if(NOT found)
    list(APPEND missing "${want}")
  endif()
endforeach()

list(LENGTH names count)
list(LENGTH leaks leaked)
list(LENGTH missing missing_count)
foreach(name IN LISTS leaks)
  message(STATUS "not public API: ${name}")
endforeach()
foreach(want IN LISTS missing)
  message(STATUS "missing: ${want}")
endforeach()
if(leaked GREATER 0 OR missing)
  message(FATAL_ERROR "${leaked} of ${count} exported symbols are not public API, "
                      "${missing_count} public ones are missing (listed above)")
endif()
message(STATUS "${count} exported symbols, all public API")
