#pragma once

#include <memory>

#include <netio3/network_backend.hpp>

namespace netio3::ucx {

// Creates the UCX backend: active messages on one UCP worker per backend, its event fd in
// the shared loop. NetworkMode::TCP restricts UCX to its tcp transport, RDMA lets UCX
// choose; UCX_TLS in the environment always wins.
[[nodiscard]] std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                                             std::shared_ptr<BaseEventLoop> loop);

}  // namespace netio3::ucx
