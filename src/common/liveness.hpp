#pragma once

// Liveness of open connections (NetworkConfig::limits.peer_timeout, docs/reliability.md).
//
// Every transport sends heartbeats in its own protocol (asyncmsg and UCX control frames,
// libfabric messages with remote CQ data) to a peer whose protocol version says it accepts
// them, and counts what arrives from the peer in ConnectionBase::arrivals. One timer per
// backend, period P = T/HEARTBEATS_PER_TIMEOUT (T = peer_timeout), runs while such a
// connection is open: each tick sends every connection whose peer takes heartbeats one, and
// a connection whose peer sends them and from which nothing arrived for T + P (its next
// heartbeat may have been due just after it went) is handed back as silent (the engine
// closes it). A peer that is gone (its host, its link, or its loop) was last heard at most P
// before, so it is noticed between T and T + 3P after it went (1.3 T; the ticks' granularity
// adds up to 2P); a healthy idle connection costs each side a heartbeat and a wake-up per
// period.
//
// Judging is suspended when it would be unfair:
//  - for a connection the transport is not reading (receive memory exhausted: the peer's
//    bytes wait in the kernel) - `receiving` below;
//  - for everyone on a tick that comes more than two periods after the previous one: the
//    loop itself was blocked (a long callback, a stopped process), and what arrived
//    meanwhile is still unread.
// Loop thread only.

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <netio3/event_loop.hpp>

#include "common/connection.hpp"

namespace netio3::detail {

inline constexpr int HEARTBEATS_PER_TIMEOUT = 10;

// How often heartbeats are sent and connections judged, for a peer timeout.
[[nodiscard]] inline std::chrono::milliseconds heartbeat_period(
    std::chrono::milliseconds peer_timeout) noexcept {
  return std::max(peer_timeout / HEARTBEATS_PER_TIMEOUT, std::chrono::milliseconds{10});
}

template <std::derived_from<ConnectionBase> Conn>
class Liveness {
 public:
  using Clock = std::chrono::steady_clock;

  // on_tick runs on the loop thread every period while a connection is watched; it calls
  // sweep().
  Liveness(BaseEventLoop& loop, std::chrono::milliseconds peer_timeout,
           std::function<void()> on_tick)
      : m_timeout{peer_timeout},
        m_period{heartbeat_period(peer_timeout)},
        m_timer{loop.create_timer(std::move(on_tick))} {}

  // Watches an open connection from now on (a peer that sends or takes heartbeats).
  void watch(const std::shared_ptr<Conn>& conn) {
    m_entries.push_back(Entry{conn, conn->arrivals, Clock::now()});
    if (!m_armed) {
      m_armed = true;
      m_last_tick.reset();
      m_timer.start(m_period);
    }
  }

  // Watches a connection again (a resumed session): from now, as if it had just opened.
  void watch_again(const std::shared_ptr<Conn>& conn) {
    std::erase_if(m_entries, [&](const Entry& entry) { return entry.conn.lock() == conn; });
    watch(conn);
  }

  struct Sweep {
    std::vector<std::shared_ptr<Conn>> beat;    // open, the peer takes heartbeats: send one
    std::vector<std::shared_ptr<Conn>> silent;  // nothing arrived for peer_timeout: close
  };

  // One tick: forgets connections no longer open (or interrupted sessions), judges the
  // others. receiving(const Conn&) -> bool: whether the transport is reading the connection.
  template <typename Receiving>
  Sweep sweep(Receiving&& receiving) {
    const auto now = Clock::now();
    const bool loop_was_blocked = m_last_tick && now - *m_last_tick > 2 * m_period;
    m_last_tick = now;
    Sweep out;
    std::erase_if(m_entries, [&](Entry& entry) {
      auto conn = entry.conn.lock();
      // An interrupted session has no transport to hear or to beat on (resumed: watched
      // again).
      if (!conn || conn->phase != Phase::OPEN || conn->session.down) return true;
      if (conn->arrivals != entry.seen || loop_was_blocked || !conn->peer_sends_heartbeats ||
          !receiving(*conn)) {
        entry.seen = conn->arrivals;
        entry.heard = now;
      } else if (now - entry.heard >= m_timeout + m_period) {
        out.silent.push_back(std::move(conn));
        return true;
      }
      if (conn->peer_takes_heartbeats) out.beat.push_back(std::move(conn));
      return false;
    });
    if (m_entries.empty()) {
      m_armed = false;
      m_timer.stop();
    }
    return out;
  }

  // Stops (backend shutdown).
  void close() {
    m_entries.clear();
    m_timer.close();
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return m_timeout; }
  [[nodiscard]] std::chrono::milliseconds period() const noexcept { return m_period; }

 private:
  struct Entry {
    std::weak_ptr<Conn> conn;
    std::uint64_t seen;  // arrivals at the last tick
    Clock::time_point heard;
  };

  const std::chrono::milliseconds m_timeout;
  const std::chrono::milliseconds m_period;
  EventTimerHandle m_timer;
  std::vector<Entry> m_entries;
  bool m_armed{false};
  std::optional<Clock::time_point> m_last_tick;
};

}  // namespace netio3::detail
