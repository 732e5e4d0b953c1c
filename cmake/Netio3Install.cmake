include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# Two install components, one Debian package each (cmake/Netio3Packaging.cmake): runtime
# (the shared library, netio3-perf) and development (headers, the libnetio3.so link, the
# CMake package, netio3.pc; the static library of a static build).
install(TARGETS netio3 EXPORT netio3Targets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime
                NAMELINK_COMPONENT development
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/netio3 DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT development)
install(FILES ${PROJECT_BINARY_DIR}/generated/include/netio3/version.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/netio3 COMPONENT development)
install(EXPORT netio3Targets NAMESPACE netio3::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/netio3 COMPONENT development)

configure_package_config_file(cmake/netio3Config.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/netio3Config.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/netio3)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/netio3ConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
# pkg-config: netio3.pc beside the CMake package. Requires.private and Libs.private are what
# a static link (pkg-config --static) needs besides netio3 itself; Boost is header-only.
set(NETIO3_PC_REQUIRES_PRIVATE "")
if("LIBFABRIC" IN_LIST NETIO3_BACKENDS)
  list(APPEND NETIO3_PC_REQUIRES_PRIVATE libfabric)
endif()
if("UCX" IN_LIST NETIO3_BACKENDS)
  list(APPEND NETIO3_PC_REQUIRES_PRIVATE ucx)
endif()
list(JOIN NETIO3_PC_REQUIRES_PRIVATE ", " NETIO3_PC_REQUIRES_PRIVATE)
# The prefix relative to the installed .pc file (lib/pkgconfig, or a multiarch libdir).
file(RELATIVE_PATH NETIO3_PC_RELATIVE_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
string(REGEX REPLACE "/$" "" NETIO3_PC_RELATIVE_PREFIX "${NETIO3_PC_RELATIVE_PREFIX}")
configure_file(cmake/netio3.pc.in ${CMAKE_CURRENT_BINARY_DIR}/netio3.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/netio3.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT development)

install(FILES ${CMAKE_CURRENT_BINARY_DIR}/netio3Config.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/netio3ConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/netio3 COMPONENT development)
