#pragma once

#include <memory>

#include <netio3/network_backend.hpp>

namespace netio3::libfabric {

// Creates the libfabric backend: connection-oriented endpoints (FI_EP_MSG) over verbs
// (NetworkMode::RDMA) or the tcp provider (NetworkMode::TCP); FI_PROVIDER overrides.
[[nodiscard]] std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                                             std::shared_ptr<BaseEventLoop> loop);

}  // namespace netio3::libfabric
