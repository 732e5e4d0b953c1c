# Dependencies come from Debian packages (see README.md). Each backend is an option that
# defaults to ON exactly when its dependency is found; forcing one ON without the
# dependency is an error rather than a silently smaller library.

find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(Boost 1.74 QUIET)

option(NETIO3_WITH_ASYNCMSG "asyncmsg backend (TCP through Boost.Asio)" ${Boost_FOUND})
if(NETIO3_WITH_ASYNCMSG AND NOT Boost_FOUND)
  message(FATAL_ERROR "NETIO3_WITH_ASYNCMSG=ON needs Boost >= 1.74 (apt-get install libboost-dev)")
endif()

set(NETIO3_BACKENDS "")
foreach(backend ASYNCMSG)
  if(NETIO3_WITH_${backend})
    list(APPEND NETIO3_BACKENDS ${backend})
  endif()
endforeach()
message(STATUS "netio3 backends: ${NETIO3_BACKENDS}")
