#include <netio3/version.hpp>

namespace netio3 {

Version version() noexcept {
  return Version{NETIO3_VERSION_MAJOR, NETIO3_VERSION_MINOR, NETIO3_VERSION_PATCH};
}

std::string_view version_string() noexcept {
  return NETIO3_VERSION_STRING;
}

}  // namespace netio3
