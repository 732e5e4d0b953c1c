#include "common/sockaddr.hpp"

#include <arpa/inet.h>
#include <array>
#include <netinet/in.h>

namespace netio3::detail {

std::optional<SocketAddress> to_socket_address(const EndPointAddress& address) {
  SocketAddress out;
  auto* in = reinterpret_cast<sockaddr_in*>(&out.storage);  // NOLINT
  if (::inet_pton(AF_INET, address.address.c_str(), &in->sin_addr) == 1) {
    in->sin_family = AF_INET;
    in->sin_port = htons(address.port);
    out.length = sizeof(sockaddr_in);
    return out;
  }
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&out.storage);  // NOLINT
  if (::inet_pton(AF_INET6, address.address.c_str(), &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(address.port);
    out.length = sizeof(sockaddr_in6);
    return out;
  }
  return std::nullopt;
}

std::optional<EndPointAddress> to_endpoint_address(const void* sockaddr, std::size_t len) {
  if (sockaddr == nullptr || len < sizeof(sa_family_t)) return std::nullopt;
  std::array<char, INET6_ADDRSTRLEN> text{};
  const auto* generic = static_cast<const struct sockaddr*>(sockaddr);
  if (generic->sa_family == AF_INET && len >= sizeof(sockaddr_in)) {
    const auto* in = static_cast<const sockaddr_in*>(sockaddr);
    ::inet_ntop(AF_INET, &in->sin_addr, text.data(), text.size());
    return EndPointAddress{text.data(), ntohs(in->sin_port)};
  }
  if (generic->sa_family == AF_INET6 && len >= sizeof(sockaddr_in6)) {
    const auto* in6 = static_cast<const sockaddr_in6*>(sockaddr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, text.data(), text.size());
    return EndPointAddress{text.data(), ntohs(in6->sin6_port)};
  }
  return std::nullopt;
}

}  // namespace netio3::detail
