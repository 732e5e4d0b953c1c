#include <array>
#include <cctype>
#include <string>

#include <fmt/format.h>
#include <netio3/network_backend.hpp>
#include <netio3/network_buffer.hpp>
#include <netio3/types.hpp>

#include "common/send_failure.hpp"

namespace netio3 {
namespace {

template <typename Enum, std::size_t N>
std::optional<Enum> parse_name(std::string_view name,
                               const std::array<std::string_view, N>& names) {
  std::string lower;
  lower.reserve(name.size());
  for (const char c : name) {
    lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  for (std::size_t i = 0; i < N; ++i) {
    if (names.at(i) == lower) return static_cast<Enum>(i);
  }
  return std::nullopt;
}

template <std::size_t N>
std::string_view name_of(std::size_t i, const std::array<std::string_view, N>& names) {
  return i < N ? names.at(i) : std::string_view{"?"};
}

constexpr std::array<std::string_view, 3> BACKEND_NAMES{"asyncmsg", "libfabric", "ucx"};
constexpr std::array<std::string_view, 2> MODE_NAMES{"rdma", "tcp"};
constexpr std::array<std::string_view, 2> SAFETY_NAMES{"safe", "unsafe"};
constexpr std::array<std::string_view, 3> STATUS_NAMES{"ok", "no_resources", "failed"};
constexpr std::array<std::string_view, 4> SEND_FAILURE_NAMES{"closing", "too_large", "invalid",
                                                             "transport"};
constexpr std::array<std::string_view, 5> CLOSE_NAMES{"local", "peer_closed", "peer_lost",
                                                      "timed_out", "protocol_error"};
constexpr std::array<std::string_view, 5> REFUSAL_NAMES{"unreachable", "timed_out", "rejected",
                                                        "setup_failed", "not_admitted"};

}  // namespace

std::string to_string(const EndPointAddress& address) {
  if (address.address.find(':') != std::string::npos) {
    return fmt::format("[{}]:{}", address.address, address.port);
  }
  return fmt::format("{}:{}", address.address, address.port);
}

std::ostream& operator<<(std::ostream& os, const EndPointAddress& address) {
  return os << to_string(address);
}

std::string_view to_string(BackendType type) noexcept {
  return name_of(static_cast<std::size_t>(type), BACKEND_NAMES);
}
std::string_view to_string(NetworkMode mode) noexcept {
  return name_of(static_cast<std::size_t>(mode), MODE_NAMES);
}
std::string_view to_string(ThreadSafetyModel model) noexcept {
  return name_of(static_cast<std::size_t>(model), SAFETY_NAMES);
}
std::string_view to_string(NetioStatus status) noexcept {
  return name_of(static_cast<std::size_t>(status), STATUS_NAMES);
}
std::string_view to_string(RefusalCause cause) noexcept {
  return name_of(static_cast<std::size_t>(cause), REFUSAL_NAMES);
}
std::string_view to_string(CloseCause cause) noexcept {
  return name_of(static_cast<std::size_t>(cause), CLOSE_NAMES);
}
std::string_view to_string(SendFailureCause cause) noexcept {
  return name_of(static_cast<std::size_t>(cause), SEND_FAILURE_NAMES);
}

namespace {
thread_local SendFailure t_last_send_failure{};
}  // namespace

const SendFailure& last_send_failure() noexcept {
  return t_last_send_failure;
}

namespace detail {
NetioStatus send_failed(SendFailureCause cause, std::string message, bool warn) {
  if (warn) NETIO3_WARN("{}", message);
  t_last_send_failure.cause = cause;
  t_last_send_failure.message = std::move(message);
  return NetioStatus::FAILED;
}
}  // namespace detail

std::optional<BackendType> parse_backend_type(std::string_view name) noexcept {
  return parse_name<BackendType>(name, BACKEND_NAMES);
}
std::optional<NetworkMode> parse_network_mode(std::string_view name) noexcept {
  return parse_name<NetworkMode>(name, MODE_NAMES);
}
std::optional<ThreadSafetyModel> parse_thread_safety_model(std::string_view name) noexcept {
  return parse_name<ThreadSafetyModel>(name, SAFETY_NAMES);
}

void NetworkBuffer::throw_overflow(std::size_t wanted) const {
  throw BufferOverflow(fmt::format(
      "NetworkBuffer {}: {} bytes do not fit, capacity is {} ({} used); nothing was written", m_id,
      wanted, m_storage.size(), m_size));
}

}  // namespace netio3
