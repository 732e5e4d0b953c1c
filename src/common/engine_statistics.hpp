#pragma once

// The connection engine's statistics: statistics(), connection_statistics(),
// backend_statistics() (any thread) and the per-connection snapshot they are made of.
// Definitions of ConnectionEngine members (common/connection_engine.hpp, which includes this
// file at its end; including this file first works as well).

#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>
#include <netio3/exceptions.hpp>
#include <netio3/statistics.hpp>

#include "common/connection_engine.hpp"

namespace netio3::detail {

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline ConnectionStatistics ConnectionEngine<Derived, Conn, Listener>::statistics(
    const EndPointAddress& address) {
  if (!m_thread.safe() && !m_loop->in_loop_thread()) {
    return on_loop([&] { return statistics(address); });
  }
  std::shared_ptr<Conn> conn;
  {
    const auto held = m_registry.lock();
    conn = m_registry.find(held, address);
  }
  if (!conn) {
    check_address(address, "statistics");
    throw UnknownActiveEndpoint(
        fmt::format("{}: statistics: no connection with {}", m_name, address));
  }
  return snapshot(*conn);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline std::vector<ConnectionStatistics>
ConnectionEngine<Derived, Conn, Listener>::connection_statistics() {
  if (!m_thread.safe() && !m_loop->in_loop_thread()) {
    return on_loop([&] { return connection_statistics(); });
  }
  std::vector<std::shared_ptr<Conn>> all;
  {
    const auto held = m_registry.lock();
    all = m_registry.connections(held);
  }
  std::vector<ConnectionStatistics> out;
  out.reserve(all.size());
  for (const auto& conn : all) out.push_back(snapshot(*conn));
  return out;
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline BackendStatistics ConnectionEngine<Derived, Conn, Listener>::backend_statistics() {
  if (!m_thread.safe() && !m_loop->in_loop_thread()) {
    return on_loop([&] { return backend_statistics(); });
  }
  std::vector<std::shared_ptr<Conn>> all;
  {
    const auto held = m_registry.lock();
    all = m_registry.connections(held);
  }
  BackendStatistics total;
  {
    // Closing connections, then those that ended: a connection is in m_ending before it
    // leaves the registry, and its counts are in m_ended before it leaves m_ending, so
    // none is missed; one seen twice is counted once (by id).
    const std::lock_guard lock{m_ending_mutex};
    for (const auto& entry : m_ending) {
      const auto id = entry.first;  // not a structured binding: clang 14 cannot capture one
      if (std::ranges::none_of(all, [id](const auto& c) { return c->id == id; })) {
        all.push_back(entry.second);
      }
    }
    total = m_ended;
  }
  for (const auto& conn : all) {
    const auto s = snapshot(*conn);
    if (s.open) {
      ++total.connections_open;
    } else if (conn->setting_up()) {
      ++total.connections_set_up;
    }
    add_counts(total, s);
  }
  return total;
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline ConnectionStatistics ConnectionEngine<Derived, Conn, Listener>::snapshot(
    const Conn& conn) const {
  ConnectionStatistics s;
  s.remote = conn.remote;
  const BufferPool* pool = nullptr;
  {
    const std::lock_guard lock{conn.mutex};
    const auto counts = conn.ledger.counts();
    s.open = conn.phase == Phase::OPEN && !conn.close_requested.load(std::memory_order_relaxed);
    if (conn.phase >= Phase::OPEN &&
        conn.established_at != std::chrono::steady_clock::time_point{}) {
      s.age = std::chrono::steady_clock::now() - conn.established_at;
    }
    s.sends_accepted = counts.accepted;
    s.sends_completed = counts.completed;
    s.sends_cancelled = counts.cancelled;
    s.bytes_sent = counts.bytes_completed;
    s.keys_in_flight = conn.ledger.outstanding();
    if constexpr (requires { Derived::queued_bytes(conn); }) {
      s.bytes_queued = Derived::queued_bytes(conn);
    }
    pool = conn.send_pool;
  }
  if (pool != nullptr) s.send_buffers_high_water = pool->high_water();
  s.sends_no_resources = conn.counters.no_resources.load(std::memory_order_relaxed);
  s.sends_failed = conn.counters.failed.load(std::memory_order_relaxed);
  s.messages_received = conn.counters.messages_received.load(std::memory_order_relaxed);
  s.bytes_received = conn.counters.bytes_received.load(std::memory_order_relaxed);
  return s;
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::add_counts(
    BackendStatistics& total, const ConnectionStatistics& s) noexcept {
  total.sends_accepted += s.sends_accepted;
  total.sends_completed += s.sends_completed;
  total.sends_cancelled += s.sends_cancelled;
  total.sends_no_resources += s.sends_no_resources;
  total.sends_failed += s.sends_failed;
  total.bytes_sent += s.bytes_sent;
  total.keys_in_flight += s.keys_in_flight;
  total.bytes_queued += s.bytes_queued;
  total.messages_received += s.messages_received;
  total.bytes_received += s.bytes_received;
}

}  // namespace netio3::detail
