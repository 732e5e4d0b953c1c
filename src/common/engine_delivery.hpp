#pragma once

// The connection engine's delivery acknowledgement (DeliveryParameters): the peer's counts
// ending sends, this side's counts of what it handed to on_data_cb (one acknowledgement per
// loop round), the replay window, and the drain of a close on an acknowledged connection.
// Definitions of ConnectionEngine members (common/connection_engine.hpp, which includes this
// file at its end; including this file first works as well).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "common/connection_engine.hpp"

namespace netio3::detail {

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline bool ConnectionEngine<Derived, Conn, Listener>::acknowledgement(
    const std::shared_ptr<Conn>& conn, std::uint64_t count) {
  std::vector<PendingSend> done;
  bool valid = false;
  SendLedger::Counts counts;
  {
    const std::lock_guard lock{conn->mutex};
    valid = conn->ledger.acknowledge(count, done);
    counts = conn->ledger.counts();
    if constexpr (requires { derived().acknowledged(*conn, count); }) {
      if (valid) derived().acknowledged(*conn, count);
    }
  }
  if (!valid) {
    return protocol_violation(
        conn,
        fmt::format("the peer acknowledged {} messages of {} sent{}", count, counts.accepted,
                    conn->acknowledged_sends.load() ? "" : " (none were to be acknowledged)"));
  }
  for (const auto& send : done) {
    if (!completed(*conn, send)) return false;
  }
  return still_open(*conn);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline NetioStatus ConnectionEngine<Derived, Conn, Listener>::draining_failure(
    const Conn& conn) const {
  return send_failed(
      SendFailureCause::CLOSING,
      fmt::format("{}: send to {}: the connection is closing (draining)", m_name, conn.remote),
      false);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline bool ConnectionEngine<Derived, Conn, Listener>::drained(const Conn& conn) {
  const std::lock_guard lock{conn.mutex};
  return conn.ledger.outstanding() == 0;
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::drain(const std::shared_ptr<Conn>& conn) {
  assert_loop_thread();
  if (!conn->draining.load() || conn->ending()) return;
  if (drained(*conn)) {
    end_drain(conn, "closed locally");
    return;
  }
  std::weak_ptr<Derived> weak = derived().weak_from_this();
  std::weak_ptr<Conn> weak_conn = conn;
  m_deadlines->arm(conn->drain_timer, conn->params.delivery.drain_timeout, [weak, weak_conn] {
    auto self = weak.lock();
    auto c = weak_conn.lock();
    if (!self || !c || self->shut_down()) return;
    std::size_t left = 0;
    {
      const std::lock_guard lock{c->mutex};
      left = c->ledger.outstanding();
    }
    self->end_drain(c, fmt::format("closed locally; {} send(s) not acknowledged within "
                                   "delivery.drain_timeout ({} ms)",
                                   left, c->params.delivery.drain_timeout.count()));
  });
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::post_drain_check(const Conn& conn) {
  std::weak_ptr<Derived> weak = derived().weak_from_this();
  m_loop->post([weak, c = owner(conn)] {
    auto self = weak.lock();
    if (self && !self->shut_down() && c->draining.load() && !c->ending() && drained(*c)) {
      self->end_drain(c, "closed locally");
    }
  });
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::end_drain(const std::shared_ptr<Conn>& conn,
                                                                 std::string_view reason) {
  if (!conn->draining.exchange(false) || conn->ending()) return;
  conn->drain_timer.cancel();
  {
    const auto held = m_registry.lock();
    if (m_registry.find(held, conn->remote) == conn) {
      (void)m_registry.take_for_close(held, conn->remote);
    }
  }
  close(conn, reason, CloseCause::LOCAL);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline bool ConnectionEngine<Derived, Conn, Listener>::window_full(const Conn& conn,
                                                                   std::uint64_t bytes) const {
  if (!conn.acknowledged_sends.load(std::memory_order_relaxed)) [[likely]] {
    return false;
  }
  std::uint64_t held = 0;
  {
    const std::lock_guard lock{conn.mutex};
    held = conn.ledger.outstanding_bytes();
  }
  return held > 0 && held + bytes > conn.params.delivery.replay_window;
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::delivered_one(const Conn& conn,
                                                                     std::size_t size) {
  ++conn.acks.delivered;
  conn.acks.bytes_unacked += size;
  if (conn.acks.bytes_unacked >= ACK_AT_ONCE_BYTES && still_open(conn)) {
    // Large messages: the sender's buffers wait for this; no need to wait for the round.
    (void)send_ack(owner(conn));
    if (conn.acks.acked == conn.acks.delivered) return;
  }
  if (conn.acks.ack_due) return;
  conn.acks.ack_due = true;
  if (!m_ack_hook) {
    std::weak_ptr<Derived> weak = derived().weak_from_this();
    m_ack_hook = m_loop->add_prepare_hook([weak] {
      if (auto self = weak.lock()) self->send_due_acks();
      return true;
    });
  }
  m_acks_due.push_back(owner(conn));
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::send_due_acks() {
  if (m_acks_due.empty() || shut_down()) return;
  m_acks_sending.swap(m_acks_due);
  for (const auto& conn : m_acks_sending) {
    conn->acks.ack_due = false;
    if (shut_down()) break;
    // Closing: close() sent what the application was handed, or the peer is gone.
    if (conn->phase == Phase::OPEN && !send_ack(conn) && conn->phase == Phase::OPEN) {
      conn->acks.ack_due = true;  // no room in the transport: next round
      m_acks_due.push_back(conn);
    }
  }
  m_acks_sending.clear();
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline bool ConnectionEngine<Derived, Conn, Listener>::send_ack(const std::shared_ptr<Conn>& conn) {
  const std::uint64_t count = conn->acks.delivered;
  if (count == conn->acks.acked) return true;
  if (!derived().send_ack(conn, count)) return false;
  conn->acks.acked = std::max(conn->acks.acked, count);
  conn->acks.bytes_unacked = 0;
  return true;
}

}  // namespace netio3::detail
