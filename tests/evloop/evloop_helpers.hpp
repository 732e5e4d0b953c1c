#pragma once

// Helpers shared by the EpollEventLoop tests. Every wait has a deadline and waits on a
// condition variable, a future or a file descriptor; nothing sleeps to synchronise.

#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <fcntl.h>
#include <future>
#include <memory>
#include <mutex>
#include <poll.h>
#include <stdexcept>
#include <string>
#include <sys/timerfd.h>
#include <system_error>
#include <thread>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

#include <netio3/event_loop.hpp>
#include <netio3/log.hpp>

#include "test_support.hpp"

namespace netio3::test::evloop {

// A file descriptor that is closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : m_fd{fd} {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : m_fd{std::exchange(other.m_fd, -1)} {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      m_fd = std::exchange(other.m_fd, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  [[nodiscard]] int get() const noexcept { return m_fd; }
  void reset() noexcept {
    if (m_fd >= 0) ::close(m_fd);
    m_fd = -1;
  }

 private:
  int m_fd{-1};
};

struct Pipe {
  Fd read;
  Fd write;
};

inline Pipe make_pipe() {
  std::array<int, 2> fds{};
  if (::pipe2(fds.data(), O_NONBLOCK | O_CLOEXEC) != 0) {
    throw std::system_error(errno, std::generic_category(), "pipe2");
  }
  return Pipe{Fd{fds[0]}, Fd{fds[1]}};
}

// Writes one byte; false if the write failed.
inline bool write_byte(int fd) {
  const std::uint8_t byte = 1;
  return ::write(fd, &byte, 1) == 1;
}

// Reads everything currently readable from a non-blocking fd; returns the byte count.
inline std::size_t drain(int fd) {
  std::array<std::uint8_t, 256> buf{};
  std::size_t total = 0;
  for (;;) {
    const auto n = ::read(fd, buf.data(), buf.size());
    if (n <= 0) break;
    total += static_cast<std::size_t>(n);
  }
  return total;
}

// Lets `delay` pass on CLOCK_MONOTONIC, the clock of the loop's timers, by waiting (with a
// deadline) for a timerfd of our own. Timers of the loop armed before this call with a
// shorter delay have expired when it returns true.
inline bool let_time_pass(std::chrono::milliseconds delay) {
  const Fd tfd{::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC)};
  if (tfd.get() < 0) return false;
  itimerspec spec{};
  spec.it_value.tv_sec = static_cast<time_t>(delay.count() / 1000);
  spec.it_value.tv_nsec = static_cast<long>((delay.count() % 1000) * 1'000'000);
  if (::timerfd_settime(tfd.get(), 0, &spec, nullptr) != 0) return false;
  pollfd pfd{tfd.get(), POLLIN, 0};
  int rc = 0;
  do {
    rc = ::poll(&pfd, 1, static_cast<int>(DEFAULT_TIMEOUT.count()));
  } while (rc < 0 && errno == EINTR);
  return rc == 1;
}

// A counter that callbacks bump and the test thread waits on.
class Counter {
 public:
  void add(int n = 1) {
    {
      const std::lock_guard lock{m_mutex};
      m_value += n;
    }
    m_cv.notify_all();
  }
  [[nodiscard]] int value() const {
    const std::lock_guard lock{m_mutex};
    return m_value;
  }
  // True once the value is at least n; false if that does not happen within the timeout.
  [[nodiscard]] bool wait_at_least(int n, std::chrono::milliseconds timeout = DEFAULT_TIMEOUT) {
    std::unique_lock lock{m_mutex};
    return m_cv.wait_for(lock, timeout, [&] { return m_value >= n; });
  }

 private:
  mutable std::mutex m_mutex;
  std::condition_variable m_cv;
  int m_value{0};
};

// Runs fn on the loop thread through post() and waits for it with a deadline; returns its
// result and rethrows its exception.
template <typename F>
auto on_loop(BaseEventLoop& loop, F fn) -> std::invoke_result_t<F&> {
  using R = std::invoke_result_t<F&>;
  auto task = std::make_shared<std::packaged_task<R()>>(std::move(fn));
  auto future = task->get_future();
  loop.post([task] { (*task)(); });
  if (future.wait_for(DEFAULT_TIMEOUT) != std::future_status::ready) {
    throw std::runtime_error("on_loop: the loop did not run the task within the deadline");
  }
  return future.get();
}

// Lets the loop complete several iterations. Each task is posted after the previous one
// ran, so it is dispatched from a later epoll_wait; after the third, every event that was
// ready when settle() was called (or became ready through the first task) has been
// dispatched, and the graveyard of closed registrations has been emptied.
inline void settle(BaseEventLoop& loop) {
  for (int i = 0; i < 3; ++i) on_loop(loop, [] {});
}

inline std::thread::id loop_thread_id(BaseEventLoop& loop) {
  return on_loop(loop, [] { return std::this_thread::get_id(); });
}

// Runs loop->run() on a thread of its own; the future is ready once run() returned.
class AsyncRun {
 public:
  explicit AsyncRun(std::shared_ptr<EpollEventLoop> loop)
      : m_loop{std::move(loop)}, m_future{std::async(std::launch::async, [l = m_loop] {
          l->run();
        })} {}
  ~AsyncRun() {
    if (m_future.valid() &&
        m_future.wait_for(std::chrono::seconds{0}) != std::future_status::ready) {
      m_loop->stop();
    }
  }
  AsyncRun(const AsyncRun&) = delete;
  AsyncRun& operator=(const AsyncRun&) = delete;
  AsyncRun(AsyncRun&&) = delete;
  AsyncRun& operator=(AsyncRun&&) = delete;

  [[nodiscard]] bool returned_within(std::chrono::milliseconds timeout) const {
    return m_future.wait_for(timeout) == std::future_status::ready;
  }
  // Rethrows what run() threw.
  void get() { m_future.get(); }

 private:
  std::shared_ptr<EpollEventLoop> m_loop;
  std::future<void> m_future;
};

using test::LogCapture;

}  // namespace netio3::test::evloop
