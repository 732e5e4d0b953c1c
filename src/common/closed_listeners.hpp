#pragma once

// Listen endpoints that the application closed but whose transport object must stay open a
// little longer. libfabric 1.17's tcp provider and UCX 1.13's tcp sockcm both free, with
// their listener, connections they accepted but had not yet reported, and later touch the
// freed memory (crashes; see docs/reliability.md). So a closed listener is kept for a grace
// period - limits.connect_timeout, the time a peer has to complete its set-up - during which
// the backend refuses every request that arrives for it, and then `release` closes it.
// Opening a listener on the same port releases the old one at once.
//
// retire() and release_port() may be called from any thread; `release` runs on the loop
// thread (timer) or in the calling thread (release_port, release_all), never under the
// internal lock.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <netio3/event_loop.hpp>

namespace netio3::detail {

template <typename Listener>
class ClosedListeners {
 public:
  using Clock = std::chrono::steady_clock;
  using Release = std::function<void(Listener&)>;

  static constexpr std::chrono::milliseconds PERIOD{250};

  ClosedListeners(BaseEventLoop& loop, std::chrono::milliseconds grace, Release release)
      : m_state{std::make_shared<State>()} {
    m_state->grace = grace;
    m_state->release = std::move(release);
    m_state->timer = loop.create_timer([weak = std::weak_ptr<State>{m_state}] {
      if (auto state = weak.lock())
        state->release_if([now = Clock::now()](const Entry& e) { return e.second <= now; });
    });
  }

  void retire(std::shared_ptr<Listener> listener) {
    const std::lock_guard lock{m_state->mutex};
    m_state->entries.emplace_back(std::move(listener), Clock::now() + m_state->grace);
    if (!m_state->armed) {
      m_state->armed = true;
      m_state->timer.start(PERIOD);
    }
  }

  void release_port(std::uint16_t port) {
    m_state->release_if([port](const Entry& e) { return e.first->address.port == port; });
  }

  // Releases all and stops (backend shutdown).
  void release_all() {
    m_state->release_if([](const Entry&) { return true; });
    const std::lock_guard lock{m_state->mutex};
    m_state->timer.close();
  }

 private:
  using Entry = std::pair<std::shared_ptr<Listener>, Clock::time_point>;

  struct State {
    template <typename Pred>
    void release_if(Pred pred) {
      std::vector<std::shared_ptr<Listener>> due;
      {
        const std::lock_guard lock{mutex};
        std::erase_if(entries, [&](Entry& e) {
          if (!pred(e)) return false;
          due.push_back(std::move(e.first));
          return true;
        });
        if (entries.empty() && armed) {
          armed = false;
          timer.stop();
        }
      }
      for (const auto& listener : due) release(*listener);
    }

    std::mutex mutex;
    std::vector<Entry> entries;
    bool armed{false};
    std::chrono::milliseconds grace{};
    Release release;
    EventTimerHandle timer;
  };

  std::shared_ptr<State> m_state;
};

}  // namespace netio3::detail
