#pragma once

// The event loop every backend runs on. One thread calls run(); every callback registered
// here (and every netio3 callback) runs on that thread. Other threads interact with the
// loop only through stop(), post(), run_sync() and EventSignalHandle::fire().

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include <netio3/export.hpp>

namespace netio3 {

namespace detail {
/// One registration inside a loop (an fd, a signal, a timer or a prepare hook). Handles
/// share it with the loop; closing it from any thread, also from inside its own callback,
/// is safe: the loop never calls a closed source's callback again.
class EventSource {
 public:
  EventSource() = default;
  EventSource(const EventSource&) = delete;
  EventSource& operator=(const EventSource&) = delete;
  EventSource(EventSource&&) = delete;
  EventSource& operator=(EventSource&&) = delete;
  virtual ~EventSource() = default;
  virtual void close() noexcept = 0;
};

class FdSource : public EventSource {
 public:
  virtual void modify(std::uint32_t events) = 0;
};

class SignalSource : public EventSource {
 public:
  virtual void fire() noexcept = 0;
};

class TimerSource : public EventSource {
 public:
  virtual void start(std::chrono::milliseconds period) = 0;
  virtual void start_once(std::chrono::milliseconds delay) = 0;
  virtual void stop() = 0;
};

/// Move-only owner of a registration; destroying it closes the registration.
template <typename Source>
class Handle {
 public:
  Handle() = default;
  explicit Handle(std::shared_ptr<Source> source) noexcept : m_source{std::move(source)} {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&&) noexcept = default;
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      close();
      m_source = std::move(other.m_source);
    }
    return *this;
  }
  ~Handle() { close(); }

  /// Unregisters; the callback will not be called again once close() returns on the loop
  /// thread. From another thread, a callback that is already running finishes normally.
  void close() noexcept {
    if (m_source) {
      m_source->close();
      m_source.reset();
    }
  }
  [[nodiscard]] explicit operator bool() const noexcept { return m_source != nullptr; }

 protected:
  [[nodiscard]] Source& source() const { return *m_source; }

 private:
  std::shared_ptr<Source> m_source;
};
}  // namespace detail

/// Readiness callback for a registered file descriptor; receives the epoll event mask.
using FdCallback = std::function<void(std::uint32_t events)>;

/// A file descriptor registered with add_fd. Move-only; destroying or closing it removes
/// the registration (the callback is not called again), the descriptor itself stays open.
class FdHandle : public detail::Handle<detail::FdSource> {
 public:
  using Handle::Handle;
  /// Changes the epoll events (EPOLLIN, EPOLLOUT, ...) the callback waits for.
  void modify(std::uint32_t events) const { source().modify(events); }
};

/// An eventfd-backed signal. fire() may be called from any thread (it is async-signal-safe
/// too); the callback runs on the loop thread. Several fire() calls before the loop wakes
/// run the callback once, unless the signal was created with semaphore semantics, in which
/// case every fire() runs it once.
class EventSignalHandle : public detail::Handle<detail::SignalSource> {
 public:
  using Handle::Handle;
  /// Makes the callback run on the loop thread. Any thread, async-signal-safe.
  void fire() const noexcept { source().fire(); }
};

/// A timerfd-backed timer, stopped until started. Expirations that pile up while the loop
/// is busy run the callback once. Call start/stop from the loop thread or any other thread.
class EventTimerHandle : public detail::Handle<detail::TimerSource> {
 public:
  using Handle::Handle;
  /// Periodic: the first expiry is one period from now. Throws std::invalid_argument for a
  /// period that is not positive.
  void start(std::chrono::milliseconds period) const { source().start(period); }
  /// One expiry, `delay` from now (replaces a running period).
  void start_once(std::chrono::milliseconds delay) const { source().start_once(delay); }
  /// No more expiries until started again.
  void stop() const { source().stop(); }
};

/// A hook called on the loop thread before the loop would block waiting for events. It
/// returns true when it is safe to sleep, false to make the loop poll once more without
/// sleeping (the pattern of fi_trywait and ucp_worker_arm).
using PrepareHook = std::function<bool()>;
/// A registered prepare hook; destroying or closing it removes the hook.
using PrepareHookHandle = detail::Handle<detail::EventSource>;

/// The event loop the backends run on: one thread dispatches every callback. An
/// application may implement it for a loop of its own; netio3 ships EpollEventLoop.
class NETIO3_API BaseEventLoop {
 public:
  BaseEventLoop() = default;
  BaseEventLoop(const BaseEventLoop&) = delete;
  BaseEventLoop& operator=(const BaseEventLoop&) = delete;
  BaseEventLoop(BaseEventLoop&&) = delete;
  BaseEventLoop& operator=(BaseEventLoop&&) = delete;
  virtual ~BaseEventLoop() = default;

  /// Dispatches events on the calling thread until stop(). If stop() was called before,
  /// returns at once (and clears the request). Functions posted but not yet run when the
  /// loop stops are run before run() returns.
  virtual void run() = 0;
  /// Any thread, also from a callback and before run(). Non-blocking.
  virtual void stop() noexcept = 0;
  /// True while a thread is inside run().
  [[nodiscard]] virtual bool is_running() const noexcept = 0;
  /// True on the thread currently inside run().
  [[nodiscard]] virtual bool in_loop_thread() const noexcept = 0;

  /// Runs fn on the loop thread soon (never inside this call), in posting order.
  virtual void post(std::function<void()> fn) = 0;
  /// Runs fn on the loop thread and waits for it to finish. Runs it at once on the calling
  /// thread when called from the loop thread or when the loop is not running. Exceptions
  /// thrown by fn are rethrown here.
  virtual void run_sync(std::function<void()> fn) = 0;

  /// The loop does not take ownership of fd; close the handle before closing the fd.
  [[nodiscard]] virtual FdHandle add_fd(int fd, std::uint32_t events, FdCallback callback) = 0;
  /// A signal whose fire() calls coalesce (see EventSignalHandle).
  [[nodiscard]] virtual EventSignalHandle create_signal(std::function<void()> callback) = 0;
  /// A signal; with `semaphore` every fire() runs the callback once.
  [[nodiscard]] virtual EventSignalHandle create_signal(std::function<void()> callback,
                                                        bool semaphore) = 0;
  /// A timer, stopped until started (see EventTimerHandle).
  [[nodiscard]] virtual EventTimerHandle create_timer(std::function<void()> callback) = 0;
  /// A hook run before each sleep of the loop (see PrepareHook).
  [[nodiscard]] virtual PrepareHookHandle add_prepare_hook(PrepareHook hook) = 0;
  /// A prepare hook that polls a transport itself each time it runs (ucp_worker_progress,
  /// fi_cq_read), so that while the loop busy-polls the transport needs no epoll_wait to be
  /// noticed. A loop may then check its own descriptors less often than once per round
  /// (EpollEventLoop::Options::busy_poll_fd_interval). Otherwise as add_prepare_hook.
  [[nodiscard]] virtual PrepareHookHandle add_polling_hook(PrepareHook hook) {
    return add_prepare_hook(std::move(hook));
  }

  /// Number of times the loop returned from waiting for events (for tests and monitoring:
  /// an idle loop does not wake up). Empty polls while busy-polling are not counted.
  [[nodiscard]] virtual std::uint64_t wakeups() const noexcept = 0;

  /// For prepare hooks, on the loop thread: true when the loop is busy-polling this round
  /// and will not sleep whatever the hooks return. A hook may then skip arming its wait
  /// object (ucp_worker_arm, fi_trywait) and just make progress; it returns false when it
  /// found work, which keeps the loop polling. A loop that never busy-polls returns false.
  [[nodiscard]] virtual bool polling() const noexcept { return false; }
};

/// The epoll(7) implementation. Thread safety: all members may be called from any thread;
/// callbacks run on the thread in run(). Destroy the loop only after run() has returned.
class NETIO3_API EpollEventLoop final : public BaseEventLoop {
 public:
  /// How the loop waits for events.
  struct Options {
    /// After a round that had work (an event, or a prepare hook that asked to poll again),
    /// keep polling without sleeping for this long before blocking in epoll_wait: trades
    /// CPU while traffic flows for fewer wake-ups (lower latency, higher message rates).
    /// An idle loop still sleeps. 0: never busy-poll.
    std::chrono::microseconds busy_poll{0};
    /// While busy-polling with a polling hook registered (add_polling_hook: the UCX and
    /// libfabric backends), the loop's own descriptors (sockets, timers, signals, post())
    /// are checked at most this often instead of every round, which saves a system call
    /// per round and so lowers the transport's latency. They may wait this long to be
    /// noticed. 0: every round. Without busy polling it does not apply.
    std::chrono::microseconds busy_poll_fd_interval{10};
  };
  /// Options from the environment: NETIO3_BUSY_POLL_US (microseconds, default 0) and
  /// NETIO3_BUSY_POLL_FD_INTERVAL_US (microseconds, default 10).
  EpollEventLoop();
  /// A loop with the given options (the environment is not read).
  explicit EpollEventLoop(Options options);
  ~EpollEventLoop() override;
  EpollEventLoop(const EpollEventLoop&) = delete;
  EpollEventLoop& operator=(const EpollEventLoop&) = delete;
  EpollEventLoop(EpollEventLoop&&) = delete;
  EpollEventLoop& operator=(EpollEventLoop&&) = delete;

  void run() override;
  void stop() noexcept override;
  [[nodiscard]] bool is_running() const noexcept override;
  [[nodiscard]] bool in_loop_thread() const noexcept override;
  void post(std::function<void()> fn) override;
  void run_sync(std::function<void()> fn) override;
  [[nodiscard]] FdHandle add_fd(int fd, std::uint32_t events, FdCallback callback) override;
  [[nodiscard]] EventSignalHandle create_signal(std::function<void()> callback) override;
  [[nodiscard]] EventSignalHandle create_signal(std::function<void()> callback,
                                                bool semaphore) override;
  [[nodiscard]] EventTimerHandle create_timer(std::function<void()> callback) override;
  [[nodiscard]] PrepareHookHandle add_prepare_hook(PrepareHook hook) override;
  [[nodiscard]] PrepareHookHandle add_polling_hook(PrepareHook hook) override;
  [[nodiscard]] std::uint64_t wakeups() const noexcept override;
  [[nodiscard]] bool polling() const noexcept override;

  // ---- embedding: driven by another event loop instead of run() ----------------------
  // For a host loop that owns the thread (Python's asyncio, libuv, Qt...): attach() makes
  // the calling thread the loop thread (is_running() and in_loop_thread() are true there)
  // until detach(). The host watches fd() for reading and calls run_once() when it is
  // readable, and also after a call into a backend of this loop that it made on that
  // thread outside run_once() (such a call may leave work for the loop: a send to flush, a
  // completion to report). Other threads use the loop as they would with run(): post(),
  // run_sync() and the backends' calls wake the host through fd(). Busy polling does not
  // apply; stop() has no effect while attached.

  /// Makes the calling thread the loop thread. Throws std::logic_error if the loop is
  /// running or attached already.
  void attach();
  /// The descriptor that is readable when run_once() has something to do (the loop's epoll
  /// instance: its own descriptors, timers, signals, posted functions).
  [[nodiscard]] int fd() const noexcept;
  /// One round on the attached thread, without blocking: dispatches what is ready, then
  /// runs the prepare hooks (the transports arm their wake-ups). Returns true when the loop
  /// may sleep until fd() is readable, false when it has more to do now (call it again
  /// soon). Throws std::logic_error when not called on the attached thread.
  bool run_once();
  /// Ends attach() on the attached thread: runs what was posted and releases the thread,
  /// as the end of run() does. Throws std::logic_error on another thread.
  void detach();

  class NETIO3_LOCAL Impl;

 private:
  std::shared_ptr<Impl> m_impl;
};

}  // namespace netio3
