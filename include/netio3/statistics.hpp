#pragma once

// Counters of a connection and of a backend (NetworkBackend::statistics and friends). A
// snapshot is taken from any thread without stopping traffic: it holds the connection's
// lock for a moment and never waits for the event loop. Counters only grow; they start at
// zero when the connection is opened or accepted.

#include <chrono>
#include <cstddef>
#include <cstdint>

#include <netio3/types.hpp>

namespace netio3 {

/// A snapshot of one connection's counters (NetworkBackend::connection_statistics).
struct ConnectionStatistics {
  EndPointAddress remote;  ///< the peer
  /// Established and not being closed (false while it is being set up).
  bool open{false};
  /// Since on_connection_established_cb (zero while it is being set up).
  std::chrono::steady_clock::duration age{};

  // ---- sending (what the send calls returned, and what became of it) ----------------
  std::uint64_t sends_accepted{};      ///< send_buffer / send_data / send_data_copy returned OK
  std::uint64_t sends_completed{};     ///< of those, reported through on_send_completed_cb
  std::uint64_t sends_cancelled{};     ///< of those, reported as keys of the closed callback
  std::uint64_t sends_no_resources{};  ///< calls that returned NO_RESOURCES
  std::uint64_t sends_failed{};        ///< calls that returned FAILED
  std::uint64_t bytes_sent{};          ///< header_data + payload of the completed sends
  /// Accepted and neither completed nor cancelled yet: sends_accepted - sends_completed -
  /// sends_cancelled.
  std::uint64_t keys_in_flight{};
  /// Accepted bytes the transport has not handed to the network yet (asyncmsg: not written
  /// to the socket; libfabric and UCX: posted and not completed).
  std::uint64_t bytes_queued{};
  /// The most send buffers (get_buffer) lent out at once from the pool the connection uses:
  /// its own, or the shared one (NetworkConfig::shared_send_buffers, for all its users).
  std::size_t send_buffers_high_water{};

  // ---- receiving ---------------------------------------------------------------------
  std::uint64_t messages_received{};  ///< on_data_cb calls
  std::uint64_t bytes_received{};     ///< bytes handed to on_data_cb
};

/// A snapshot of a backend's counters (NetworkBackend::backend_statistics).
struct BackendStatistics {
  std::size_t connections_open{};      ///< established, not being closed
  std::size_t connections_set_up{};    ///< being set up
  std::uint64_t connections_closed{};  ///< reported closed (or dropped during set-up) so far
  // The rest: sums over the connections the backend has now and every one it had, of the
  // counters of ConnectionStatistics with the same names.
  std::uint64_t sends_accepted{};      ///< sum of ConnectionStatistics::sends_accepted
  std::uint64_t sends_completed{};     ///< sum of ConnectionStatistics::sends_completed
  std::uint64_t sends_cancelled{};     ///< sum of ConnectionStatistics::sends_cancelled
  std::uint64_t sends_no_resources{};  ///< sum of ConnectionStatistics::sends_no_resources
  std::uint64_t sends_failed{};        ///< sum of ConnectionStatistics::sends_failed
  std::uint64_t bytes_sent{};          ///< sum of ConnectionStatistics::bytes_sent
  std::uint64_t keys_in_flight{};      ///< sum of ConnectionStatistics::keys_in_flight
  std::uint64_t bytes_queued{};        ///< sum of ConnectionStatistics::bytes_queued
  std::uint64_t messages_received{};   ///< sum of ConnectionStatistics::messages_received
  std::uint64_t bytes_received{};      ///< sum of ConnectionStatistics::bytes_received
};

}  // namespace netio3
