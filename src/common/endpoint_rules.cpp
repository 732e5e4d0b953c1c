#include "common/endpoint_rules.hpp"

#include <arpa/inet.h>
#include <array>

#include <fmt/format.h>
#include <netio3/exceptions.hpp>

#include "common/admission.hpp"

namespace netio3::detail {

void check_address(const EndPointAddress& address, std::string_view action) {
  std::array<unsigned char, sizeof(in6_addr)> buf{};
  if (address.address.empty()) {
    throw InvalidEndpointAddress(
        fmt::format("{}: empty IP address (port {})", action, address.port));
  }
  if (::inet_pton(AF_INET, address.address.c_str(), buf.data()) == 1 ||
      ::inet_pton(AF_INET6, address.address.c_str(), buf.data()) == 1) {
    return;
  }
  throw InvalidEndpointAddress(
      fmt::format("{}: '{}' is not a numeric IPv4 or IPv6 address (host names are not resolved)",
                  action, address.address));
}

void check_config(const NetworkConfig& config) {
  const auto& rx = config.shared_receive_buffers;
  if (rx.use_shared_receive_buffers && (rx.num_buf == 0 || rx.buf_size == 0)) {
    throw InvalidConfiguration(
        fmt::format("shared receive buffers need num_buf > 0 and buf_size > 0 (got {} x {})",
                    rx.num_buf, rx.buf_size));
  }
  const auto& tx = config.shared_send_buffers;
  if (tx.use_shared_send_buffers && (tx.num_buf == 0 || tx.buf_size == 0)) {
    throw InvalidConfiguration(
        fmt::format("shared send buffers need num_buf > 0 and buf_size > 0 (got {} x {})",
                    tx.num_buf, tx.buf_size));
  }
  if (config.limits.max_message_size == 0) {
    throw InvalidConfiguration("limits.max_message_size must be > 0");
  }
  if (config.limits.max_unsent_bytes == 0) {
    throw InvalidConfiguration("limits.max_unsent_bytes must be > 0");
  }
  if (config.limits.max_receive_memory < config.limits.max_message_size) {
    throw InvalidConfiguration(
        fmt::format("limits.max_receive_memory ({}) must be at least limits.max_message_size ({})",
                    config.limits.max_receive_memory, config.limits.max_message_size));
  }
  if (config.limits.connect_timeout.count() <= 0) {
    throw InvalidConfiguration("limits.connect_timeout must be > 0");
  }
  if (config.limits.close_timeout.count() <= 0) {
    throw InvalidConfiguration("limits.close_timeout must be > 0");
  }
  if (config.limits.peer_timeout.count() <= 0) {
    throw InvalidConfiguration("limits.peer_timeout must be > 0");
  }
  if (config.limits.max_interrupted_sessions == 0) {
    throw InvalidConfiguration("limits.max_interrupted_sessions must be > 0");
  }
  check_admission_config(config);
  if (config.on_data_cb && config.on_data_from_cb) {
    throw InvalidConfiguration(
        "set one of on_data_cb and on_data_from_cb (on_data_from_cb is on_data_cb with the "
        "sender)");
  }
  if (config.on_connection_refused_cb && config.on_connection_refused_reason_cb) {
    throw InvalidConfiguration(
        "set one of on_connection_refused_cb and on_connection_refused_reason_cb "
        "(on_connection_refused_reason_cb is on_connection_refused_cb with the reason)");
  }
  if (config.on_connection_closed_cb && config.on_connection_closed_reason_cb) {
    throw InvalidConfiguration(
        "set one of on_connection_closed_cb and on_connection_closed_reason_cb "
        "(on_connection_closed_reason_cb is on_connection_closed_cb with the reason)");
  }
}

void check_connection_parameters(const ConnectionParameters& params, const NetworkConfig& config,
                                 bool listen_endpoint) {
  const auto fail = [](std::string_view why) {
    throw InvalidConnectionParameters(fmt::format("invalid connection parameters: {}", why));
  };
  const auto& rx = params.recv_params;
  if (rx.num_buf > 0 && rx.buf_size == 0) fail("recv_params.num_buf > 0 with buf_size 0");
  if (rx.use_shared_receive_buffers && !listen_endpoint) {
    fail("recv_params.use_shared_receive_buffers applies to listen endpoints only");
  }
  if (rx.use_shared_receive_buffers && config.shared_receive_buffers.use_shared_receive_buffers) {
    fail(
        "recv_params.use_shared_receive_buffers conflicts with the backend-wide shared receive "
        "buffers");
  }
  const auto& tx = params.send_buffered_params;
  if (tx.num_buf > 0 && tx.buf_size == 0) fail("send_buffered_params.num_buf > 0 with buf_size 0");
  const auto& shared_tx = config.shared_send_buffers;
  if (shared_tx.use_shared_send_buffers && tx.num_buf > 0 && tx.buf_size > shared_tx.buf_size) {
    fail(fmt::format("send_buffered_params.buf_size {} exceeds the shared send buffers' {}",
                     tx.buf_size, shared_tx.buf_size));
  }
  const auto& zc = params.send_zero_copy_params;
  if (zc.mr_start != nullptr && zc.buf_size == 0) {
    fail("send_zero_copy_params.mr_start set with buf_size 0");
  }
  if (params.delivery.acknowledged && params.delivery.replay_window == 0) {
    fail("delivery.acknowledged with a replay_window of 0 bytes");
  }
  const auto& session = params.delivery.session;
  if (session.enabled) {
    if (params.delivery.replay_window == 0)
      fail("delivery.session with a replay_window of 0 bytes");
    if (session.first_delay.count() <= 0 || session.max_delay < session.first_delay ||
        session.give_up.count() <= 0) {
      fail(fmt::format(
          "delivery.session: first_delay {} ms, max_delay {} ms and give_up {} ms "
          "must be positive, max_delay at least first_delay",
          session.first_delay.count(), session.max_delay.count(), session.give_up.count()));
    }
  }
}

}  // namespace netio3::detail
