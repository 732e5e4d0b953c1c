#pragma once

// Many one-shot deadlines on one timer descriptor: a connection's drain timeout, a session's
// next resume attempt and its give-up. A timer descriptor each would cost a process two per
// interrupted session (a server keeps up to limits.max_interrupted_sessions of them), and a
// process at its descriptor limit could not keep a session at all. The timer is armed for
// the earliest deadline; at its expiry every deadline that has passed runs, in deadline
// order, on the loop thread, with no lock held (a callback may arm or cancel any deadline).
//
// A Deadline is the handle of one: arming it again replaces the earlier arming, destroying
// or cancelling it means its callback does not run. Deadlines::close() (backend shutdown)
// cancels everything. Arm and cancel from the loop thread (a Deadline handle itself is not
// synchronised; the queue is, so that a handle may be destroyed on any thread).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <netio3/event_loop.hpp>

#include "common/log.hpp"

namespace netio3::detail {

class Deadlines;

class Deadline {
 public:
  Deadline() = default;
  ~Deadline() { cancel(); }
  Deadline(const Deadline&) = delete;
  Deadline& operator=(const Deadline&) = delete;
  Deadline(Deadline&&) = delete;
  Deadline& operator=(Deadline&&) = delete;

  // Its callback will not run (unless armed again).
  void cancel() noexcept;
  [[nodiscard]] bool armed() const noexcept;

 private:
  friend class Deadlines;
  struct State;
  std::weak_ptr<State> m_state;
  std::uint64_t m_id{0};
};

struct Deadline::State {
  using Key = std::pair<std::chrono::steady_clock::time_point, std::uint64_t>;

  // Under `mutex`: the timer's one expiry for the earliest deadline.
  void rearm() {
    if (queue.empty()) {
      timer.stop();
      return;
    }
    const auto earliest = queue.begin()->first.first;
    const auto delay =
        std::chrono::ceil<std::chrono::milliseconds>(earliest - std::chrono::steady_clock::now());
    timer.start_once(std::max(delay, std::chrono::milliseconds{1}));
  }

  // The timer expired: every deadline that has passed runs (unlocked), then the timer is
  // armed for the next.
  // A deadline cancelled by an earlier callback of the same expiry does not run.
  void expire() {
    std::vector<std::pair<std::uint64_t, std::function<void()>>> due;
    {
      const std::lock_guard lock{mutex};
      const auto now = std::chrono::steady_clock::now();
      while (!queue.empty() && queue.begin()->first.first <= now) {
        auto node = queue.extract(queue.begin());
        due.emplace_back(node.key().second, std::move(node.mapped()));
      }
      if (!closed) rearm();
    }
    for (auto& [id, callback] : due) {
      {
        const std::lock_guard lock{mutex};
        if (closed || when.erase(id) == 0) continue;  // cancelled meanwhile
      }
      try {
        callback();
      } catch (const std::exception& e) {
        // The others of this expiry still run (each had a timer of its own before).
        NETIO3_ERROR("netio3: a deadline's callback failed: {}", e.what());
      }
    }
  }

  void cancel(std::uint64_t id) {
    std::function<void()> dropped;  // freed after the lock (it may hold the last owners)
    const std::lock_guard lock{mutex};
    const auto it = when.find(id);
    if (it == when.end()) return;
    // Not in the queue when its expiry is running: erasing it from `when` keeps it from running.
    const auto node = queue.find(Key{it->second, id});
    if (node != queue.end()) {
      dropped = std::move(node->second);
      queue.erase(node);
    }
    when.erase(it);
  }

  mutable std::mutex mutex;
  EventTimerHandle timer;
  std::multimap<Key, std::function<void()>> queue;
  std::unordered_map<std::uint64_t, std::chrono::steady_clock::time_point> when;  // by id
  std::uint64_t next_id{0};
  bool closed{false};
};

class Deadlines {
 public:
  using Clock = std::chrono::steady_clock;

  // Throws what create_timer throws (no descriptor for the timer).
  explicit Deadlines(BaseEventLoop& loop) : m_state{std::make_shared<Deadline::State>()} {
    m_state->timer = loop.create_timer([weak = std::weak_ptr<Deadline::State>{m_state}] {
      if (auto state = weak.lock()) state->expire();
    });
  }
  ~Deadlines() { close(); }
  Deadlines(const Deadlines&) = delete;
  Deadlines& operator=(const Deadlines&) = delete;
  Deadlines(Deadlines&&) = delete;
  Deadlines& operator=(Deadlines&&) = delete;

  // `callback` runs on the loop thread `delay` from now (at least 1 ms), unless `deadline` is
  // cancelled, armed again or destroyed before. Ignored after close().
  void arm(Deadline& deadline, std::chrono::milliseconds delay, std::function<void()> callback) {
    deadline.cancel();
    const auto when = Clock::now() + std::max(delay, std::chrono::milliseconds{1});
    const std::lock_guard lock{m_state->mutex};
    if (m_state->closed) return;
    const std::uint64_t id = ++m_state->next_id;
    m_state->queue.emplace(Deadline::State::Key{when, id}, std::move(callback));
    m_state->when.emplace(id, when);
    deadline.m_state = m_state;
    deadline.m_id = id;
    m_state->rearm();
  }

  // Deadlines armed and not yet run or cancelled (tests).
  [[nodiscard]] std::size_t pending() const {
    const std::lock_guard lock{m_state->mutex};
    return m_state->queue.size();
  }

  // Cancels every deadline; nothing runs afterwards.
  void close() noexcept {
    std::multimap<Deadline::State::Key, std::function<void()>> dropped;  // freed unlocked
    const std::lock_guard lock{m_state->mutex};
    m_state->closed = true;
    dropped.swap(m_state->queue);
    m_state->when.clear();
    m_state->timer.close();
  }

 private:
  std::shared_ptr<Deadline::State> m_state;
};

inline void Deadline::cancel() noexcept {
  if (auto state = m_state.lock()) state->cancel(m_id);
  m_state.reset();
}

inline bool Deadline::armed() const noexcept {
  const auto state = m_state.lock();
  if (!state) return false;
  const std::lock_guard lock{state->mutex};
  return state->when.contains(m_id);
}

}  // namespace netio3::detail
