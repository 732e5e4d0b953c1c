#pragma once

// Conversions between EndPointAddress (numeric IPv4/IPv6 text + port) and struct sockaddr,
// for the transports that take or report socket addresses (libfabric, UCX).

#include <cstddef>
#include <optional>
#include <sys/socket.h>

#include <netio3/types.hpp>

namespace netio3::detail {

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length{0};
  [[nodiscard]] const sockaddr* get() const noexcept {
    return reinterpret_cast<const sockaddr*>(&storage);  // NOLINT
  }
};

// nullopt unless `address` is a numeric IPv4 or IPv6 address.
[[nodiscard]] std::optional<SocketAddress> to_socket_address(const EndPointAddress& address);

// The address in a sockaddr (IPv4 or IPv6) as an EndPointAddress; nullopt for other families
// or a length too short for the family.
[[nodiscard]] std::optional<EndPointAddress> to_endpoint_address(const void* sockaddr,
                                                                 std::size_t len);

}  // namespace netio3::detail
