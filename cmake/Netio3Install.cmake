include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS netio3 EXPORT netio3Targets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/netio3 DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_BINARY_DIR}/generated/include/netio3/version.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/netio3)
install(EXPORT netio3Targets NAMESPACE netio3::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/netio3)

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
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

install(FILES ${CMAKE_CURRENT_BINARY_DIR}/netio3Config.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/netio3ConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/netio3)
