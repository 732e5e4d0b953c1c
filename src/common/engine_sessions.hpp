#pragma once

// The connection engine's sessions (DeliveryParameters::Session; docs/sessions.md): an
// interrupted connection kept for a resume, the back-off of the connecting side's attempts, the
// give-up deadline, and the resumption.
// Definitions of ConnectionEngine members (common/connection_engine.hpp, which includes this
// file at its end; including this file first works as well).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "common/connection_engine.hpp"

namespace netio3::detail {

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline ConnectionBase::SessionId ConnectionEngine<Derived, Conn, Listener>::new_session_id() {
  ConnectionBase::SessionId id{};
  std::random_device device;
  for (std::size_t i = 0; i < id.size(); i += 4) {
    const std::uint32_t word = device();
    std::memcpy(id.data() + i, &word, 4);
  }
  return id;
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline bool ConnectionEngine<Derived, Conn, Listener>::interrupts(const Conn& conn,
                                                                  CloseCause cause) noexcept {
  return !conn.session.giving_up && conn.session.resumes.expired() && conn.phase == Phase::OPEN &&
         (cause == CloseCause::ERROR || cause == CloseCause::SILENT) &&
         !conn.close_requested.load();
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::interrupt(const std::shared_ptr<Conn>& conn,
                                                                 std::string_view reason,
                                                                 CloseCause cause) {
  auto& session = conn->session;
  if (session.down) {
    // A resume in progress broke (the GO never came): its transport connection goes too;
    // the client tries again.
    derived().detach_transport(conn, cause);
    return;
  }
  {
    const std::lock_guard lock{conn->mutex};
    session.down = true;
  }
  session.down_since = std::chrono::steady_clock::now();
  session.reason = std::string{reason};
  session.attempts = 0;
  conn->acks.ack_due = false;
  NETIO3_WARN("{}: connection with {} interrupted: {}; {} (for at most {} ms)", m_name,
              conn->remote, reason,
              conn->active() ? "reconnecting" : "waiting for the peer to resume it",
              session.give_up.count());
  derived().detach_transport(conn, cause);
  std::weak_ptr<Derived> weak = derived().weak_from_this();
  std::weak_ptr<Conn> weak_conn = conn;
  m_deadlines->arm(session.give_up_timer, session.give_up, [weak, weak_conn] {
    auto self = weak.lock();
    auto c = weak_conn.lock();
    if (self && c && !self->shut_down()) self->give_up(c);
  });
  if (conn->active()) {
    schedule_attempt(conn);
  } else {
    keep_interrupted_within_limit();
  }
  // Either may have given this one up: then it is closed, not interrupted.
  if (shut_down() || conn->ending()) return;
  if (m_api_depth > 0) {
    // Caused by an API call on the loop thread: reported after it has returned.
    m_loop->post([weak, conn, reason = session.reason] {
      auto self = weak.lock();
      if (self && !self->shut_down()) self->m_notifier.interrupted(conn->remote, reason);
    });
    return;
  }
  m_notifier.interrupted(conn->remote, session.reason);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::keep_interrupted_within_limit() {
  const std::size_t limit = m_config.limits.max_interrupted_sessions;
  std::vector<std::shared_ptr<Conn>> down;
  {
    const auto held = m_registry.lock();
    for (auto& c : m_registry.connections(held)) {
      if (!c->active() && c->session.down && !c->ending()) down.push_back(std::move(c));
    }
  }
  while (down.size() > limit && !shut_down()) {
    std::unordered_map<std::string, std::size_t> per_host;
    for (const auto& c : down) ++per_host[c->remote.address];
    const auto victim = std::ranges::min_element(down, [&](const auto& a, const auto& b) {
      const auto na = per_host[a->remote.address];
      const auto nb = per_host[b->remote.address];
      return na != nb ? na > nb : a->session.down_since < b->session.down_since;
    });
    const auto conn = *victim;
    down.erase(victim);
    give_up(conn, fmt::format("too many interrupted sessions: limits.max_interrupted_sessions "
                              "({}) reached, and {} held the most of them; this was its oldest",
                              limit, conn->remote.address));
  }
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::schedule_attempt(
    const std::shared_ptr<Conn>& conn) {
  auto& session = conn->session;
  const auto& p = conn->params.delivery.session;
  auto delay = p.first_delay;
  for (int i = 0; i < session.attempts && delay < p.max_delay; ++i) delay *= 2;
  delay = std::min(delay, p.max_delay);
  thread_local std::minstd_rand jitter{std::random_device{}()};
  delay = delay / 2 + std::chrono::milliseconds{std::uniform_int_distribution<std::int64_t>{
                          0, delay.count() / 2}(jitter)};
  ++session.attempts;
  NETIO3_DEBUG("{}: resuming the connection with {}: attempt {} in {} ms", m_name, conn->remote,
               session.attempts, delay.count());
  std::weak_ptr<Derived> weak = derived().weak_from_this();
  std::weak_ptr<Conn> weak_conn = conn;
  m_deadlines->arm(session.retry_timer, delay, [weak, weak_conn] {
    auto self = weak.lock();
    auto c = weak_conn.lock();
    if (!self || !c || self->shut_down() || c->ending() || !c->session.down) return;
    c->session.carrier = self->resume_transport(c);
    if (!c->session.carrier && !c->ending()) self->schedule_attempt(c);
  });
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline std::shared_ptr<ConnectionBase> ConnectionEngine<Derived, Conn, Listener>::resume_transport(
    const std::shared_ptr<Conn>& conn) {
  return derived().resume_transport(conn);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::carrier_lost(
    const std::shared_ptr<Conn>& target, const std::shared_ptr<Conn>& carrier,
    std::string_view reason) {
  if (target->session.carrier == carrier) target->session.carrier.reset();
  if (target->ending() || !target->session.down || shut_down()) return;
  NETIO3_DEBUG("{}: resuming the connection with {}: attempt {} failed: {}", m_name, target->remote,
               target->session.attempts, reason);
  target->session.reason = std::string{reason};
  schedule_attempt(target);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::give_up(const std::shared_ptr<Conn>& conn,
                                                               std::string_view why) {
  if (conn->ending()) return;
  conn->session.giving_up = true;
  const auto reason = why.empty()
                          ? fmt::format(
                                "the session was not resumed within delivery.session.give_up "
                                "({} ms; interrupted: {})",
                                conn->session.give_up.count(), conn->session.reason)
                          : std::string{why};
  NETIO3_WARN("{}: closing connection with {}: {}", m_name, conn->remote, reason);
  close(conn, reason, CloseCause::ERROR);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::end_session(
    const std::shared_ptr<Conn>& conn) {
  auto& session = conn->session;
  session.retry_timer.cancel();
  session.give_up_timer.cancel();
  if (auto carrier = std::exchange(session.carrier, nullptr)) {
    carrier->session.resumes.reset();
    close(std::static_pointer_cast<Conn>(carrier), "the session ended", CloseCause::LOCAL, false);
  }
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline bool ConnectionEngine<Derived, Conn, Listener>::resumed(const std::shared_ptr<Conn>& conn,
                                                               std::uint64_t peer_delivered) {
  auto& session = conn->session;
  {
    const std::lock_guard lock{conn->mutex};
    session.down = false;
  }
  session.give_up_timer.cancel();
  session.retry_timer.cancel();
  session.carrier.reset();
  session.attempts = 0;
  const auto outage = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - session.down_since);
  ++conn->arrivals;
  if (conn->peer_sends_heartbeats || conn->peer_takes_heartbeats) m_liveness->watch_again(conn);
  NETIO3_INFO(
      "{}: connection with {} resumed after {} ms; the peer had delivered {} of its "
      "messages",
      m_name, conn->remote, outage.count(), peer_delivered);
  if (!acknowledgement(conn, peer_delivered)) return false;
  m_notifier.resumed(conn->remote, outage);
  if (!still_open(*conn)) return false;
  return ready_again(*conn);
}

}  // namespace netio3::detail
