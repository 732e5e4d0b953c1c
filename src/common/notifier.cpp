#include "common/notifier.hpp"

#include <exception>

#include "common/log.hpp"

namespace netio3::detail {
namespace {

template <typename F, typename... Args>
void guarded(bool stopped, std::string_view backend, std::string_view which, const F& f,
             Args&&... args) {
  if (!f || stopped) return;
  try {
    f(std::forward<Args>(args)...);
  } catch (const std::exception& e) {
    NETIO3_ERROR("{}: exception escaped {}: {}", backend, which, e.what());
  } catch (...) {
    NETIO3_ERROR("{}: unknown exception escaped {}", backend, which);
  }
}

}  // namespace

Notifier::Notifier(std::string_view backend_name, const NetworkConfig& config)
    : m_name{backend_name},
      m_on_data{config.on_data_cb},
      m_on_data_from{config.on_data_from_cb},
      m_on_established{config.on_connection_established_cb},
      m_on_closed{config.on_connection_closed_cb},
      m_on_closed_reason{config.on_connection_closed_reason_cb},
      m_on_refused{config.on_connection_refused_cb},
      m_on_refused_reason{config.on_connection_refused_reason_cb},
      m_on_send_completed{config.on_send_completed_cb},
      m_on_ready_to_send{config.on_ready_to_send_cb},
      m_on_interrupted{config.on_connection_interrupted_cb},
      m_on_resumed{config.on_connection_resumed_cb} {}

void Notifier::data(const EndPointAddress& remote, std::span<const std::uint8_t> bytes) const {
  NETIO3_TRACE("{}: recv from {} size={}", m_name, remote, bytes.size());
  if (m_on_data_from) {
    guarded(stopped(), m_name, "on_data_from_cb", m_on_data_from, remote, bytes);
  } else {
    guarded(stopped(), m_name, "on_data_cb", m_on_data, bytes);
  }
}

void Notifier::established(const EndPointAddress& remote, const EndpointCapabilities& caps) const {
  NETIO3_DEBUG("{}: connection with {} established (buffered={} copy={} zero_copy={} receive={})",
               m_name, remote, caps.send_buffered, caps.send_copy, caps.send_zero_copy,
               caps.receive);
  guarded(stopped(), m_name, "on_connection_established_cb", m_on_established, remote, caps);
}

void Notifier::closed(const EndPointAddress& remote, const std::vector<std::uint64_t>& keys,
                      const CloseReason& reason) const {
  NETIO3_DEBUG("{}: connection with {} closed ({}: {}), {} send(s) cancelled", m_name, remote,
               reason.cause, reason.message, keys.size());
  if (m_on_closed_reason) {
    guarded(stopped(), m_name, "on_connection_closed_reason_cb", m_on_closed_reason, remote, keys,
            reason);
  } else {
    guarded(stopped(), m_name, "on_connection_closed_cb", m_on_closed, remote, keys);
  }
}

void Notifier::refused(const EndPointAddress& remote, RefusalCause cause,
                       std::string_view reason) const {
  NETIO3_DEBUG("{}: connection to {} refused ({}): {}", m_name, remote, cause, reason);
  if (m_on_refused_reason) {
    guarded(stopped(), m_name, "on_connection_refused_reason_cb", m_on_refused_reason, remote,
            RefusalReason{cause, std::string{reason}});
  } else {
    guarded(stopped(), m_name, "on_connection_refused_cb", m_on_refused, remote);
  }
}

void Notifier::send_completed(const EndPointAddress& remote, std::uint64_t key) const {
  NETIO3_TRACE("{}: send to {} completed key={}", m_name, remote, key);
  guarded(stopped(), m_name, "on_send_completed_cb", m_on_send_completed, remote, key);
}

void Notifier::ready_to_send(const EndPointAddress& remote) const {
  NETIO3_TRACE("{}: connection with {} can take sends again", m_name, remote);
  guarded(stopped(), m_name, "on_ready_to_send_cb", m_on_ready_to_send, remote);
}

void Notifier::interrupted(const EndPointAddress& remote, const std::string& reason) const {
  guarded(stopped(), m_name, "on_connection_interrupted_cb", m_on_interrupted, remote, reason);
}

void Notifier::resumed(const EndPointAddress& remote, std::chrono::milliseconds outage) const {
  guarded(stopped(), m_name, "on_connection_resumed_cb", m_on_resumed, remote, outage);
}

}  // namespace netio3::detail
