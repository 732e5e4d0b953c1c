# Debian packages: `cpack -G DEB` in the build directory makes
#   libnetio3-<soversion>  the shared library and netio3-perf (component runtime);
#   libnetio3-dev          headers, libnetio3.so, the CMake package and netio3.pc
#                          (component development);
#   python3-netio3         the Python package (component python; with NETIO3_WITH_PYTHON).
# The runtime package's dependencies (libucx0, libfabric1, libfmt9, libstdc++6, ...) are
# computed by dpkg-shlibdeps from what the binaries link; the development package depends
# on the runtime package of the same version and on what its headers and netio3.pc need.
set(CPACK_PACKAGE_NAME netio3)
set(CPACK_PACKAGE_VENDOR "netio3")
set(CPACK_PACKAGE_CONTACT "netio3 developers <netio3-dev@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_GENERATOR DEB)
set(CPACK_COMPONENTS_ALL runtime development)
if(NETIO3_WITH_PYTHON)
  list(APPEND CPACK_COMPONENTS_ALL python)
endif()
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "https://localhost/netio3")

set(netio3_runtime_package libnetio3-${PROJECT_VERSION_MAJOR})
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME ${netio3_runtime_package})
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION
    "The netio3 shared library and netio3-perf.
netio3 moves data between processes and hosts over UCX, libfabric or TCP (asyncmsg),
with one API and one event loop. netio3-perf measures throughput and latency.")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
# dpkg-shlibdeps resolves netio3-perf's libnetio3 in the package being built.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${PROJECT_BINARY_DIR}/src)
# A shlibs file, so that packages built against libnetio3 depend on it.
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
# Without debug information (a RelWithDebInfo build carries 40 MB of it).
set(CPACK_STRIP_FILES ON)

set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_NAME libnetio3-dev)
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEVELOPMENT_DESCRIPTION
    "netio3 development files.
Headers, the CMake package (find_package(netio3)) and netio3.pc (pkg-config).")
# fmt: the public headers include it. libsodium-dev, libucx-dev, libfabric-dev: netio3.pc names them in
# Requires.private, which pkg-config resolves also for a shared link.
set(netio3_dev_depends
    "${netio3_runtime_package} (= ${PROJECT_VERSION}), libfmt-dev, libsodium-dev")
if("UCX" IN_LIST NETIO3_BACKENDS)
  string(APPEND netio3_dev_depends ", libucx-dev")
endif()
if("LIBFABRIC" IN_LIST NETIO3_BACKENDS)
  string(APPEND netio3_dev_depends ", libfabric-dev")
endif()
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_DEPENDS "${netio3_dev_depends}")

# The Python package, for the interpreter it was built with (its extension module's ABI).
set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-netio3)
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
set(CPACK_DEBIAN_PYTHON_DESCRIPTION
    "netio3 for Python: the C++ API one to one and an asyncio layer.
import netio3: listeners, connections, zero-copy sends from buffer-protocol objects and
awaitable completions over asyncmsg, libfabric and UCX.")
set(CPACK_DEBIAN_PYTHON_PACKAGE_SHLIBDEPS ON)
if(NETIO3_WITH_PYTHON)
  math(EXPR netio3_python_next "${Python_VERSION_MINOR} + 1")
  set(netio3_python_this "${Python_VERSION_MAJOR}.${Python_VERSION_MINOR}")
  set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS
      "${netio3_runtime_package} (= ${PROJECT_VERSION}), python3 (>= ${netio3_python_this}), python3 (<< ${Python_VERSION_MAJOR}.${netio3_python_next})")
endif()

include(CPack)
