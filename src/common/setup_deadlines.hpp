#pragma once

// Connections that must be established before a deadline (NetworkConfig::limits.
// connect_timeout), or must reach some other state in time (`what` and `pending` say which). A
// periodic timer runs only while some connection is being set up; on the loop thread it logs each
// one that is still pending past its deadline and hands it to `on_expired` with the reason. track()
// may be called from any thread.

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <netio3/event_loop.hpp>

#include "common/log.hpp"

namespace netio3::detail {

template <typename Conn>
class SetupDeadlines {
 public:
  using Clock = std::chrono::steady_clock;
  // pending(conn): still being set up (evaluated on the loop thread).
  using Pending = std::function<bool(const Conn&)>;
  using Expired = std::function<void(const std::shared_ptr<Conn>&, const std::string& reason)>;

  static constexpr std::chrono::milliseconds PERIOD{100};

  // `backend` names the backend in the log. `what` names the deadline in the reason ("<what>
  // timed out after N ms"), which is logged as a warning unless `log_expiry` is false.
  SetupDeadlines(BaseEventLoop& loop, std::string_view backend, std::chrono::milliseconds timeout,
                 Pending pending, Expired on_expired, std::string_view what = "connection set-up",
                 bool log_expiry = true)
      : m_state{std::make_shared<State>()} {
    m_state->backend = backend;
    m_state->what = what;
    m_state->log_expiry = log_expiry;
    m_state->timeout = timeout;
    m_state->pending = std::move(pending);
    m_state->on_expired = std::move(on_expired);
    m_state->timer = loop.create_timer([weak = std::weak_ptr<State>{m_state}] {
      if (auto state = weak.lock()) state->check();
    });
  }

  // Returns the deadline.
  Clock::time_point track(const std::shared_ptr<Conn>& conn) {
    const auto deadline = Clock::now() + m_state->timeout;
    track(conn, deadline);
    return deadline;
  }
  // With a deadline of its own (a set-up that goes on in a new connection object keeps the
  // first one's).
  void track(const std::shared_ptr<Conn>& conn, Clock::time_point deadline) {
    const std::lock_guard lock{m_state->mutex};
    m_state->entries.emplace_back(conn, deadline);
    if (!m_state->armed) {
      m_state->armed = true;
      m_state->timer.start(PERIOD);
    }
  }

  // Stops watching (backend shutdown); nothing expires afterwards.
  void close() {
    const std::lock_guard lock{m_state->mutex};
    m_state->entries.clear();
    m_state->timer.close();
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return m_state->timeout; }

 private:
  struct State {
    void check() {
      const auto now = Clock::now();
      std::vector<std::shared_ptr<Conn>> expired;
      {
        const std::lock_guard lock{mutex};
        std::erase_if(entries, [&](auto& entry) {
          auto conn = entry.first.lock();
          if (!conn || !pending(*conn)) return true;
          if (now < entry.second) return false;
          expired.push_back(std::move(conn));
          return true;
        });
        if (entries.empty()) {
          armed = false;
          timer.stop();
        }
      }
      if (expired.empty()) return;
      const auto reason = fmt::format("{} timed out after {} ms", what, timeout.count());
      for (const auto& conn : expired) {
        if (log_expiry) NETIO3_WARN("{}: connection with {}: {}", backend, conn->remote, reason);
        on_expired(conn, reason);
      }
    }

    std::mutex mutex;
    std::vector<std::pair<std::weak_ptr<Conn>, Clock::time_point>> entries;
    bool armed{false};
    std::string_view backend;
    std::string_view what;
    bool log_expiry{true};
    std::chrono::milliseconds timeout{};
    Pending pending;
    Expired on_expired;
    EventTimerHandle timer;
  };

  std::shared_ptr<State> m_state;
};

}  // namespace netio3::detail
