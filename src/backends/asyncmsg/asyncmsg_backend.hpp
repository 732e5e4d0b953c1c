#pragma once

#include <memory>

#include <netio3/network_backend.hpp>

namespace netio3::asyncmsg {

// Creates the asyncmsg (TCP through Boost.Asio sockets) backend. Always thread-safe,
// whatever config.thread_safety says (see the documentation).
[[nodiscard]] std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                                             std::shared_ptr<BaseEventLoop> loop);

}  // namespace netio3::asyncmsg
