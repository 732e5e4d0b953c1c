#pragma once

// The user's callback table, called on the loop thread with logging around each call.
// A missing callback is skipped; an exception escaping one is logged and swallowed so that
// the transport's state (half-parsed streams, key accounting) stays consistent.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <netio3/types.hpp>

namespace netio3::detail {

class Notifier {
 public:
  Notifier(std::string_view backend_name, const NetworkConfig& config);

  void data(const EndPointAddress& remote, std::span<const std::uint8_t> bytes) const;
  void established(const EndPointAddress& remote, const EndpointCapabilities& caps) const;
  void closed(const EndPointAddress& remote, const std::vector<std::uint64_t>& cancelled_keys,
              const CloseReason& reason) const;
  void refused(const EndPointAddress& remote, RefusalCause cause, std::string_view reason) const;
  void send_completed(const EndPointAddress& remote, std::uint64_t key) const;
  void ready_to_send(const EndPointAddress& remote) const;
  void interrupted(const EndPointAddress& remote, const std::string& reason) const;
  void resumed(const EndPointAddress& remote, std::chrono::milliseconds outage) const;
  // Whether the application asked for on_ready_to_send_cb (else refusals are not tracked).
  [[nodiscard]] bool wants_ready_to_send() const noexcept { return bool{m_on_ready_to_send}; }

  [[nodiscard]] std::string_view name() const noexcept { return m_name; }

  // Destruction of the backend has begun (BackendFacade's destructor, on any thread): from
  // now on no callback starts. One already running ends normally; the destructor's shutdown
  // runs on the loop thread after it. Costs one load per callback.
  void stop() const noexcept { m_stopped.store(true); }
  [[nodiscard]] bool stopped() const noexcept { return m_stopped.load(std::memory_order_acquire); }

 private:
  std::string_view m_name;
  OnDataCb m_on_data;
  OnDataFromCb m_on_data_from;
  OnConnectionEstablishedCb m_on_established;
  OnConnectionClosedKeysCb m_on_closed;
  OnConnectionClosedReasonCb m_on_closed_reason;
  OnConnectionRefusedCb m_on_refused;
  OnConnectionRefusedReasonCb m_on_refused_reason;
  OnSendCompleted m_on_send_completed;
  OnReadyToSendCb m_on_ready_to_send;
  OnConnectionInterruptedCb m_on_interrupted;
  OnConnectionResumedCb m_on_resumed;
  mutable std::atomic<bool> m_stopped{false};
};

}  // namespace netio3::detail
