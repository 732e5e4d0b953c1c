include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS netio3 EXPORT netio3Targets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/netio3 DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT netio3Targets NAMESPACE netio3::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/netio3)

configure_package_config_file(cmake/netio3Config.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/netio3Config.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/netio3)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/netio3ConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/netio3Config.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/netio3ConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/netio3)
