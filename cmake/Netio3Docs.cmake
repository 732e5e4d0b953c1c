# `cmake --build <dir> --target docs`: the API reference of the public headers (Doxygen,
# docs/Doxyfile.in), in <dir>/docs/html. Fails on any Doxygen warning, an undocumented
# public member included. Not part of `all`.
find_package(Doxygen QUIET)
if(NOT DOXYGEN_FOUND)
  message(STATUS "netio3 docs: doxygen not found, no docs target (apt-get install doxygen)")
  return()
endif()
set(NETIO3_DOCS_OUTPUT ${PROJECT_BINARY_DIR}/docs)
configure_file(${PROJECT_SOURCE_DIR}/docs/Doxyfile.in ${NETIO3_DOCS_OUTPUT}/Doxyfile @ONLY)
file(GLOB netio3_doc_inputs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/include/netio3/*.hpp)
add_custom_command(
  OUTPUT ${NETIO3_DOCS_OUTPUT}/html/index.html
  COMMAND Doxygen::doxygen ${NETIO3_DOCS_OUTPUT}/Doxyfile
  DEPENDS ${netio3_doc_inputs} ${PROJECT_SOURCE_DIR}/docs/api_mainpage.md
          ${PROJECT_BINARY_DIR}/generated/include/netio3/version.hpp
          ${NETIO3_DOCS_OUTPUT}/Doxyfile
  WORKING_DIRECTORY ${NETIO3_DOCS_OUTPUT}
  COMMENT "API reference (Doxygen)"
  VERBATIM)
add_custom_target(docs DEPENDS ${NETIO3_DOCS_OUTPUT}/html/index.html)
