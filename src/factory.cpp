#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netio3/network_backend.hpp>

#include "common/endpoint_rules.hpp"
#include "common/tcp.hpp"

#ifdef NETIO3_WITH_ASYNCMSG
#include "backends/asyncmsg/asyncmsg_backend.hpp"
#endif
#ifdef NETIO3_WITH_LIBFABRIC
#include "backends/libfabric/libfabric_backend.hpp"
#endif
#ifdef NETIO3_WITH_UCX
#include "backends/ucx/ucx_backend.hpp"
#endif

namespace netio3 {

std::vector<BackendType> Netio3Backend::available() {
  std::vector<BackendType> types;
#ifdef NETIO3_WITH_ASYNCMSG
  types.push_back(BackendType::ASYNCMSG);
#endif
#ifdef NETIO3_WITH_LIBFABRIC
  types.push_back(BackendType::LIBFABRIC);
#endif
#ifdef NETIO3_WITH_UCX
  types.push_back(BackendType::UCX);
#endif
  return types;
}

bool Netio3Backend::is_available(BackendType type) {
  const auto types = available();
  return std::find(types.begin(), types.end(), type) != types.end();
}

std::unique_ptr<NetworkBackend> Netio3Backend::create(BackendType type, NetworkConfig config,
                                                      std::shared_ptr<BaseEventLoop> event_loop) {
  if (!event_loop) throw std::invalid_argument("Netio3Backend::create: event loop is null");
  detail::check_config(config);
  // A process that runs out of descriptors can neither accept nor connect, and UCX's tcp
  // transport then closes its listener for good: every backend starts by using what the hard
  // limit allows (docs/semantics.md, "Descriptors").
  detail::raise_descriptor_limit();
  switch (type) {
#ifdef NETIO3_WITH_ASYNCMSG
    case BackendType::ASYNCMSG:
      return asyncmsg::create_backend(std::move(config), std::move(event_loop));
#endif
#ifdef NETIO3_WITH_LIBFABRIC
    case BackendType::LIBFABRIC:
      return libfabric::create_backend(std::move(config), std::move(event_loop));
#endif
#ifdef NETIO3_WITH_UCX
    case BackendType::UCX:
      return ucx::create_backend(std::move(config), std::move(event_loop));
#endif
    default:
      break;
  }
  std::vector<std::string_view> names;
  for (const auto t : available()) names.push_back(to_string(t));
  throw InvalidConfiguration(
      fmt::format("Netio3Backend::create: backend '{}' is not compiled into this build of netio3 "
                  "(available: {})",
                  type, fmt::join(names, ", ")));
}

}  // namespace netio3
