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

# libfabric ships no CMake package; pkg-config finds it.
find_package(PkgConfig QUIET)
set(NETIO3_LIBFABRIC_FOUND OFF)
if(PkgConfig_FOUND)
  pkg_check_modules(LIBFABRIC QUIET IMPORTED_TARGET libfabric>=1.9)
  if(LIBFABRIC_FOUND)
    set(NETIO3_LIBFABRIC_FOUND ON)
  endif()
endif()
option(NETIO3_WITH_LIBFABRIC "libfabric backend (RDMA via verbs, or TCP)" ${NETIO3_LIBFABRIC_FOUND})
if(NETIO3_WITH_LIBFABRIC AND NOT NETIO3_LIBFABRIC_FOUND)
  message(FATAL_ERROR
    "NETIO3_WITH_LIBFABRIC=ON needs libfabric >= 1.9 found by pkg-config (apt-get install libfabric-dev)")
endif()

# libsodium (admission: the partition key's HMAC and random nonces, docs/admission.md) has no
# CMake package either. Required: admission is a security feature, and a build without it
# would have to refuse every configuration that asks for it.
if(NOT PkgConfig_FOUND)
  message(FATAL_ERROR "netio3 needs pkg-config to find libsodium (apt-get install pkg-config)")
endif()
pkg_check_modules(SODIUM QUIET IMPORTED_TARGET libsodium>=1.0.18)
if(NOT SODIUM_FOUND)
  message(FATAL_ERROR "netio3 needs libsodium >= 1.0.18 found by pkg-config for admission "
                      "(apt-get install libsodium-dev)")
endif()

# UCX ships a CMake package only in newer releases; pkg-config (ucx.pc) finds Debian's.
set(NETIO3_UCX_FOUND OFF)
if(PkgConfig_FOUND)
  pkg_check_modules(UCX QUIET IMPORTED_TARGET ucx>=1.12)
  if(UCX_FOUND)
    set(NETIO3_UCX_FOUND ON)
  endif()
endif()
option(NETIO3_WITH_UCX "UCX backend (active messages over any UCX transport)" ${NETIO3_UCX_FOUND})
if(NETIO3_WITH_UCX AND NOT NETIO3_UCX_FOUND)
  message(FATAL_ERROR "NETIO3_WITH_UCX=ON needs UCX >= 1.12 found by pkg-config (apt-get install libucx-dev)")
endif()

set(NETIO3_BACKENDS "")
foreach(backend ASYNCMSG LIBFABRIC UCX)
  if(NETIO3_WITH_${backend})
    list(APPEND NETIO3_BACKENDS ${backend})
  endif()
endforeach()
message(STATUS "netio3 backends: ${NETIO3_BACKENDS}")

# Python (the netio3 package, python/): Debian's interpreter and pybind11 (apt-get install
# python3-dev pybind11-dev). /usr/bin/python3 unless Python_EXECUTABLE says otherwise: the
# `python3` first on PATH may be another interpreter that lacks them. Not in sanitizer builds
# (the interpreter would need the sanitizer's runtime preloaded) nor static ones.
if(NOT DEFINED Python_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "The Python of the netio3 package")
endif()
set(NETIO3_PYTHON_FOUND OFF)
find_package(Python 3.8 QUIET COMPONENTS Interpreter Development.Module)
if(Python_FOUND)
  set(PYBIND11_FINDPYTHON ON)
  find_package(pybind11 2.6 CONFIG QUIET)
  if(pybind11_FOUND)
    set(NETIO3_PYTHON_FOUND ON)
  endif()
endif()
set(netio3_python_default OFF)
if(NETIO3_PYTHON_FOUND AND NETIO3_SANITIZER STREQUAL "" AND BUILD_SHARED_LIBS)
  set(netio3_python_default ON)
endif()
option(NETIO3_WITH_PYTHON "The Python package (pybind11, python/)" ${netio3_python_default})
if(NETIO3_WITH_PYTHON AND NOT NETIO3_PYTHON_FOUND)
  message(FATAL_ERROR "NETIO3_WITH_PYTHON=ON needs Python 3 with its headers and pybind11 "
                      "(apt-get install python3-dev pybind11-dev)")
endif()
if(NETIO3_WITH_PYTHON)
  message(STATUS "netio3 Python package: ${Python_EXECUTABLE} (${Python_VERSION}), pybind11 "
                 "${pybind11_VERSION}")
endif()
