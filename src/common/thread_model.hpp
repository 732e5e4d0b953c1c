#pragma once

// ThreadSafetyModel handling shared by the backends.
//
// SAFE: internal state is guarded by mutexes and any thread may call the API.
// UNSAFE: the application promises to call only from the loop thread (or while the loop
// is not running); the mutexes become no-ops and every API entry checks the promise.

#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <netio3/event_loop.hpp>
#include <netio3/types.hpp>

namespace netio3::detail {

// A mutex that can be switched off at construction (BasicLockable either way).
class OptionalMutex {
 public:
  explicit OptionalMutex(bool enabled = true) noexcept : m_enabled{enabled} {}
  void lock() {
    if (m_enabled) m_mutex.lock();
  }
  void unlock() noexcept {
    if (m_enabled) m_mutex.unlock();
  }
  bool try_lock() { return !m_enabled || m_mutex.try_lock(); }
  [[nodiscard]] bool enabled() const noexcept { return m_enabled; }

 private:
  std::mutex m_mutex;
  bool m_enabled;
};

class ThreadModel {
 public:
  ThreadModel(ThreadSafetyModel model, const BaseEventLoop& loop) noexcept
      : m_model{model}, m_loop{&loop} {}

  [[nodiscard]] bool safe() const noexcept { return m_model == ThreadSafetyModel::SAFE; }
  [[nodiscard]] ThreadSafetyModel model() const noexcept { return m_model; }

  // Throws std::logic_error when an UNSAFE backend is called from a foreign thread while
  // its loop runs: such a call would race with the loop without any lock.
  void check_caller(std::string_view api) const {
    if (m_model == ThreadSafetyModel::UNSAFE && m_loop->is_running() && !m_loop->in_loop_thread()) {
      throw std::logic_error(fmt::format(
          "netio3: {} called from a thread other than the event-loop thread on a backend "
          "created with ThreadSafetyModel::UNSAFE; call it from a callback, signal or timer, "
          "or use ThreadSafetyModel::SAFE",
          api));
    }
  }

 private:
  ThreadSafetyModel m_model;
  const BaseEventLoop* m_loop;
};

}  // namespace netio3::detail
