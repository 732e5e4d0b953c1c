// EpollEventLoop: one epoll instance, level-triggered registrations.
//
// Lifetime of registrations: epoll_event.data carries a raw Registration*. A registration
// is owned by its handle's source object; when it is closed it is removed from epoll and
// parked in a graveyard that the loop empties just before it calls epoll_wait again. A
// pointer returned by epoll_wait therefore always points to a live object, and a closed
// registration's callback is never called (its state is checked before each call).

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <system_error>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <netio3/event_loop.hpp>

#include "common/environment.hpp"
#include "common/log.hpp"

namespace netio3 {
namespace {

[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// Calls a user callback; an exception must not unwind through the dispatcher.
template <typename F, typename... Args>
void invoke_guarded(const char* what, F& f, Args&&... args) noexcept {
  try {
    f(std::forward<Args>(args)...);
  } catch (const std::exception& e) {
    NETIO3_ERROR("event loop: exception escaped a {} callback: {}", what, e.what());
  } catch (...) {
    NETIO3_ERROR("event loop: unknown exception escaped a {} callback", what);
  }
}

enum class RegState : int { NEW, ACTIVE, CLOSED };

struct Registration {
  explicit Registration(int fd_, FdCallback cb, bool owns) noexcept
      : fd{fd_}, callback{std::move(cb)}, owns_fd{owns} {}
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  Registration(Registration&&) = delete;
  Registration& operator=(Registration&&) = delete;
  ~Registration() {
    if (owns_fd && fd >= 0) ::close(fd);
  }
  int fd;
  FdCallback callback;
  bool owns_fd;
  std::atomic<RegState> state{RegState::NEW};
};

constexpr std::size_t MAX_EVENTS = 128;

// A prepare hook. `closed` is set (under the hook mutex) when its handle closes: the loop
// thread's snapshot of the hooks may still hold it, but never calls it again.
struct Hook {
  Hook(PrepareHook fn_, bool polls_transport_) noexcept
      : fn{std::move(fn_)}, polls_transport{polls_transport_} {}
  PrepareHook fn;
  const bool polls_transport;
  std::atomic<bool> closed{false};
};
// epoll_event.data of the loop's own wake-up eventfd (registrations are never at address 0).
constexpr std::uint64_t WAKE_TAG = 0;

}  // namespace

class EpollEventLoop::Impl : public std::enable_shared_from_this<Impl> {
 public:
  explicit Impl(const EpollEventLoop::Options& options)
      : m_busy_poll{std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            options.busy_poll)},
        m_fd_interval{std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            options.busy_poll_fd_interval)} {
    m_epfd = ::epoll_create1(EPOLL_CLOEXEC);
    if (m_epfd < 0) throw_errno("epoll_create1");
    m_wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (m_wake_fd < 0) {
      const int err = errno;
      ::close(m_epfd);
      throw std::system_error(err, std::generic_category(), "eventfd");
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = WAKE_TAG;
    if (::epoll_ctl(m_epfd, EPOLL_CTL_ADD, m_wake_fd, &ev) != 0) {
      const int err = errno;
      ::close(m_wake_fd);
      ::close(m_epfd);
      throw std::system_error(err, std::generic_category(), "epoll_ctl(wake fd)");
    }
  }

  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  Impl(Impl&&) = delete;
  Impl& operator=(Impl&&) = delete;

  ~Impl() {
    ::close(m_wake_fd);
    ::close(m_epfd);
  }

  void run() {
    begin("run");
    std::array<epoll_event, MAX_EVENTS> events{};
    const bool busy_poll = m_busy_poll.count() > 0;
    using Clock = std::chrono::steady_clock;
    auto poll_until = Clock::time_point{};
    auto next_fd_poll = Clock::time_point{};
    while (!m_stop.load(std::memory_order_acquire)) {
      const auto round_start = busy_poll ? Clock::now() : Clock::time_point{};
      const bool spin = busy_poll && round_start < poll_until;
      m_polling.store(spin, std::memory_order_relaxed);
      const HookRound hooks = run_prepare_hooks();
      clear_graveyard();
      if (m_stop.load(std::memory_order_acquire)) break;
      if (spin && hooks.transport_polled && round_start < next_fd_poll) {
        // A hook polled its transport this round; the descriptors wait for their turn
        // (Options::busy_poll_fd_interval): one system call per round fewer.
        if (!hooks.may_sleep) poll_until = round_start + m_busy_poll;
        continue;
      }
      const int n = ::epoll_wait(m_epfd, events.data(), static_cast<int>(events.size()),
                                 hooks.may_sleep && !spin ? -1 : 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        NETIO3_ERROR("event loop: epoll_wait failed: {}", std::strerror(errno));
        break;
      }
      if (busy_poll) {
        const auto now = Clock::now();
        next_fd_poll = now + m_fd_interval;
        if (n > 0 || !hooks.may_sleep) poll_until = now + m_busy_poll;
      }
      if (n > 0 || !spin) m_wakeups.fetch_add(1, std::memory_order_relaxed);
      for (int i = 0; i < n; ++i) {
        dispatch(events.at(static_cast<std::size_t>(i)));
        if (m_stop.load(std::memory_order_acquire)) break;
      }
    }
    end();
  }

  // ---- embedding (EpollEventLoop::attach) ----------------------------------------------

  void attach() {
    begin("attach");
    m_attached = true;
  }

  [[nodiscard]] int fd() const noexcept { return m_epfd; }

  bool run_once() {
    if (!m_attached || !in_loop_thread()) {
      throw std::logic_error("EpollEventLoop::run_once: not on the thread that called attach()");
    }
    std::array<epoll_event, MAX_EVENTS> events{};
    clear_graveyard();
    const int n = ::epoll_wait(m_epfd, events.data(), static_cast<int>(events.size()), 0);
    if (n < 0 && errno != EINTR) {
      NETIO3_ERROR("event loop: epoll_wait failed: {}", std::strerror(errno));
    }
    if (n > 0) m_wakeups.fetch_add(1, std::memory_order_relaxed);
    for (int i = 0; i < n; ++i) dispatch(events.at(static_cast<std::size_t>(i)));
    // The hooks last: the transports are armed when the host loop goes to sleep.
    const HookRound hooks = run_prepare_hooks();
    clear_graveyard();
    return hooks.may_sleep;
  }

  void detach() {
    if (!m_attached || !in_loop_thread()) {
      throw std::logic_error("EpollEventLoop::detach: not on the thread that called attach()");
    }
    m_attached = false;
    end();
  }

 private:
  void begin(const char* who) {
    if (m_running.exchange(true)) {
      throw std::logic_error(fmt::format("EpollEventLoop::{}: already running", who));
    }
    m_loop_thread.store(std::this_thread::get_id());
    // Published under the post mutex so that run_sync() sees a consistent state.
    const std::lock_guard lock{m_post_mutex};
    m_accepting_sync = true;
  }

  void end() {
    m_stop.store(false, std::memory_order_release);
    // Run what was posted before we stopped; run_sync callers waiting on it are released.
    for (;;) {
      std::vector<std::function<void()>> tasks;
      {
        const std::lock_guard lock{m_post_mutex};
        if (m_posted.empty()) {
          m_accepting_sync = false;
          break;
        }
        tasks.swap(m_posted);
        m_wake_pending = false;
      }
      for (auto& task : tasks) invoke_guarded("posted", task);
    }
    clear_graveyard();
    m_hook_snapshot.clear();  // closed hooks' functions are released with it
    m_snapshot_generation = 0;
    m_loop_thread.store(std::thread::id{});
    m_running.store(false);
  }

 public:
  void stop() noexcept {
    m_stop.store(true, std::memory_order_release);
    wake();
  }

  [[nodiscard]] bool is_running() const noexcept { return m_running.load(); }
  [[nodiscard]] bool in_loop_thread() const noexcept {
    return m_loop_thread.load() == std::this_thread::get_id();
  }

  void post(std::function<void()> fn) {
    bool need_wake = false;
    {
      const std::lock_guard lock{m_post_mutex};
      m_posted.push_back(std::move(fn));
      need_wake = !std::exchange(m_wake_pending, true);
    }
    if (need_wake) wake();
  }

  void run_sync(std::function<void()> fn) {
    if (in_loop_thread()) {
      fn();
      return;
    }
    struct Waiter {
      std::mutex mutex;
      std::condition_variable cv;
      bool done{false};
      std::exception_ptr error;
    };
    auto waiter = std::make_shared<Waiter>();
    bool queued = false;
    bool need_wake = false;
    {
      const std::lock_guard lock{m_post_mutex};
      if (m_accepting_sync) {
        m_posted.emplace_back([waiter, &fn] {
          std::exception_ptr error;
          try {
            fn();
          } catch (...) {
            error = std::current_exception();
          }
          const std::lock_guard wl{waiter->mutex};
          waiter->error = std::move(error);
          waiter->done = true;
          waiter->cv.notify_all();
        });
        queued = true;
        need_wake = !std::exchange(m_wake_pending, true);
      }
    }
    if (!queued) {
      fn();  // loop not running: nothing else dispatches concurrently
      return;
    }
    if (need_wake) wake();
    std::unique_lock wl{waiter->mutex};
    waiter->cv.wait(wl, [&] { return waiter->done; });
    // The caller takes sole ownership of the exception: the loop thread may drop the last
    // reference to the waiter, and must not be the one to destroy the exception object.
    if (std::exception_ptr error = std::exchange(waiter->error, nullptr)) {
      wl.unlock();
      std::rethrow_exception(error);
    }
  }

  std::shared_ptr<Registration> add(int fd, std::uint32_t events, FdCallback cb, bool owns_fd) {
    auto reg = std::make_shared<Registration>(fd, std::move(cb), owns_fd);
    // Release-publish the fully built registration; dispatch() acquires the state.
    reg->state.store(RegState::ACTIVE, std::memory_order_release);
    epoll_event ev{};
    ev.events = events;
    ev.data.ptr = reg.get();
    if (::epoll_ctl(m_epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      const int err = errno;
      reg->state.store(RegState::CLOSED);
      throw std::system_error(err, std::generic_category(),
                              fmt::format("epoll_ctl(ADD, fd {})", fd));
    }
    return reg;
  }

  void modify(const std::shared_ptr<Registration>& reg, std::uint32_t events) const {
    if (reg->state.load(std::memory_order_acquire) != RegState::ACTIVE) return;
    epoll_event ev{};
    ev.events = events;
    ev.data.ptr = reg.get();
    if (::epoll_ctl(m_epfd, EPOLL_CTL_MOD, reg->fd, &ev) != 0) {
      throw std::system_error(errno, std::generic_category(),
                              fmt::format("epoll_ctl(MOD, fd {})", reg->fd));
    }
  }

  void remove(std::shared_ptr<Registration> reg) noexcept {
    RegState expected = RegState::ACTIVE;
    if (!reg->state.compare_exchange_strong(expected, RegState::CLOSED)) return;
    // ENOENT/EBADF are harmless here: the fd was already gone.
    ::epoll_ctl(m_epfd, EPOLL_CTL_DEL, reg->fd, nullptr);
    // Without a run() in progress no epoll_wait result can point to it: the registration
    // (and the fd it owns) goes with its source instead of waiting for the next run().
    if (!m_running.load()) return;
    {
      const std::lock_guard lock{m_graveyard_mutex};
      m_graveyard.push_back(std::move(reg));
    }
    // From another thread the loop may be asleep: wake it so that the graveyard (and the fd
    // a signal or timer owns) is released now, not at the next unrelated event.
    if (!in_loop_thread()) wake();
  }

  void add_hook(const std::shared_ptr<Hook>& hook) {
    const std::lock_guard lock{m_hook_mutex};
    m_hooks.push_back(hook);
    m_hook_generation.fetch_add(1, std::memory_order_release);
  }

  void remove_hook(const std::shared_ptr<Hook>& hook) noexcept {
    {
      const std::lock_guard lock{m_hook_mutex};
      hook->closed.store(true, std::memory_order_release);
      std::erase(m_hooks, hook);
      m_hook_generation.fetch_add(1, std::memory_order_release);
    }
    // The loop thread's snapshot drops the hook's function in its next round: from another
    // thread, make that round come now (as for fds, whose graveyard is emptied the same way).
    if (!in_loop_thread()) wake();
  }

  [[nodiscard]] bool polling() const noexcept { return m_polling.load(std::memory_order_relaxed); }

  [[nodiscard]] std::uint64_t wakeups() const noexcept {
    return m_wakeups.load(std::memory_order_relaxed);
  }

  void wake() const noexcept {
    const std::uint64_t one = 1;
    // EAGAIN means the counter is saturated: the loop is awake anyway.
    [[maybe_unused]] const auto n = ::write(m_wake_fd, &one, sizeof(one));
  }

 private:
  void dispatch(const epoll_event& ev) {
    if (ev.data.u64 == WAKE_TAG) {
      run_posted();
      return;
    }
    auto* reg = static_cast<Registration*>(ev.data.ptr);
    if (reg->state.load(std::memory_order_acquire) != RegState::ACTIVE) return;
    invoke_guarded("fd", reg->callback, ev.events);
  }

  void run_posted() {
    std::uint64_t counter = 0;
    [[maybe_unused]] const auto n = ::read(m_wake_fd, &counter, sizeof(counter));
    std::vector<std::function<void()>> tasks;
    {
      const std::lock_guard lock{m_post_mutex};
      tasks.swap(m_posted);
      m_wake_pending = false;
    }
    for (auto& task : tasks) {
      invoke_guarded("posted", task);
    }
  }

  struct HookRound {
    bool may_sleep{true};
    bool transport_polled{false};  // a hook that polls its transport ran
  };

  // Runs the hooks from a snapshot that is taken again only when a hook was added or
  // closed (no lock and no copy per round while the set stays the same).
  HookRound run_prepare_hooks() {
    if (const auto generation = m_hook_generation.load(std::memory_order_acquire);
        generation != m_snapshot_generation) {
      const std::lock_guard lock{m_hook_mutex};
      m_hook_snapshot = m_hooks;
      m_snapshot_generation = m_hook_generation.load(std::memory_order_relaxed);
    }
    HookRound round;
    // By index: a hook may add or close hooks (the snapshot changes only next round), and
    // the snapshot keeps every hook in it alive.
    const std::size_t count = m_hook_snapshot.size();
    for (std::size_t i = 0; i < count; ++i) {
      Hook& hook = *m_hook_snapshot[i];
      // Skip a hook closed since the snapshot was taken (e.g. by an earlier hook).
      if (hook.closed.load(std::memory_order_acquire)) continue;
      bool ok = true;
      try {
        ok = hook.fn();
      } catch (const std::exception& e) {
        NETIO3_ERROR("event loop: exception escaped a prepare hook: {}", e.what());
      } catch (...) {
        NETIO3_ERROR("event loop: unknown exception escaped a prepare hook");
      }
      round.may_sleep = round.may_sleep && ok;
      round.transport_polled = round.transport_polled || hook.polls_transport;
    }
    return round;
  }

  void clear_graveyard() {
    std::vector<std::shared_ptr<Registration>> dead;
    {
      const std::lock_guard lock{m_graveyard_mutex};
      dead.swap(m_graveyard);
    }
  }

  int m_epfd{-1};
  int m_wake_fd{-1};
  std::atomic<bool> m_running{false};
  std::atomic<bool> m_stop{false};
  std::atomic<std::thread::id> m_loop_thread{};
  std::atomic<std::uint64_t> m_wakeups{0};
  const std::chrono::steady_clock::duration m_busy_poll;
  const std::chrono::steady_clock::duration m_fd_interval;
  std::atomic<bool> m_polling{false};  // written and read on the loop thread
  bool m_attached{false};              // attach() .. detach(); loop thread only

  std::mutex m_post_mutex;
  std::vector<std::function<void()>> m_posted;
  bool m_wake_pending{false};
  bool m_accepting_sync{false};

  std::mutex m_graveyard_mutex;
  std::vector<std::shared_ptr<Registration>> m_graveyard;

  std::mutex m_hook_mutex;
  std::vector<std::shared_ptr<Hook>> m_hooks;
  std::atomic<std::uint64_t> m_hook_generation{0};
  // Loop thread only.
  std::vector<std::shared_ptr<Hook>> m_hook_snapshot;
  std::uint64_t m_snapshot_generation{0};
};

namespace {

// Common part of every source: the registration and a weak reference to the loop, so
// that a handle that outlives its loop closes harmlessly.
class SourceBase {
 public:
  SourceBase(std::weak_ptr<EpollEventLoop::Impl> loop, std::shared_ptr<Registration> reg)
      : m_loop{std::move(loop)}, m_reg{std::move(reg)} {}

 protected:
  void close_registration() noexcept {
    if (auto loop = m_loop.lock()) {
      loop->remove(m_reg);
    } else {
      m_reg->state.store(RegState::CLOSED);
    }
  }
  [[nodiscard]] const std::shared_ptr<Registration>& reg() const noexcept { return m_reg; }
  [[nodiscard]] std::shared_ptr<EpollEventLoop::Impl> loop() const { return m_loop.lock(); }

 private:
  std::weak_ptr<EpollEventLoop::Impl> m_loop;
  std::shared_ptr<Registration> m_reg;
};

class EpollFdSource final : public detail::FdSource, SourceBase {
 public:
  using SourceBase::SourceBase;
  ~EpollFdSource() override { close_registration(); }
  EpollFdSource(const EpollFdSource&) = delete;
  EpollFdSource& operator=(const EpollFdSource&) = delete;
  EpollFdSource(EpollFdSource&&) = delete;
  EpollFdSource& operator=(EpollFdSource&&) = delete;
  void close() noexcept override { close_registration(); }
  void modify(std::uint32_t events) override {
    if (auto l = loop()) l->modify(reg(), events);
  }
};

class EpollSignalSource final : public detail::SignalSource, SourceBase {
 public:
  using SourceBase::SourceBase;
  ~EpollSignalSource() override { close_registration(); }
  EpollSignalSource(const EpollSignalSource&) = delete;
  EpollSignalSource& operator=(const EpollSignalSource&) = delete;
  EpollSignalSource(EpollSignalSource&&) = delete;
  EpollSignalSource& operator=(EpollSignalSource&&) = delete;
  void close() noexcept override { close_registration(); }
  void fire() noexcept override {
    const std::uint64_t one = 1;
    // The eventfd lives as long as this source, so this never writes to a recycled fd.
    [[maybe_unused]] const auto n = ::write(reg()->fd, &one, sizeof(one));
  }
};

class EpollTimerSource final : public detail::TimerSource, SourceBase {
 public:
  using SourceBase::SourceBase;
  ~EpollTimerSource() override { close_registration(); }
  EpollTimerSource(const EpollTimerSource&) = delete;
  EpollTimerSource& operator=(const EpollTimerSource&) = delete;
  EpollTimerSource(EpollTimerSource&&) = delete;
  EpollTimerSource& operator=(EpollTimerSource&&) = delete;
  void close() noexcept override { close_registration(); }
  void start(std::chrono::milliseconds period) override { arm(period, period); }
  void start_once(std::chrono::milliseconds delay) override {
    arm(delay, std::chrono::milliseconds{0});
  }
  void stop() override { set(itimerspec{}); }

 private:
  void arm(std::chrono::milliseconds first, std::chrono::milliseconds period) {
    if (first.count() <= 0) throw std::invalid_argument("EventTimerHandle: period must be > 0");
    itimerspec spec{};
    spec.it_value = to_timespec(first);
    spec.it_interval = to_timespec(period);
    set(spec);
  }
  void set(const itimerspec& spec) {
    if (::timerfd_settime(reg()->fd, 0, &spec, nullptr) != 0) throw_errno("timerfd_settime");
  }
  static timespec to_timespec(std::chrono::milliseconds ms) {
    timespec ts{};
    ts.tv_sec = static_cast<time_t>(ms.count() / 1000);
    ts.tv_nsec = static_cast<long>((ms.count() % 1000) * 1'000'000);
    return ts;
  }
};

class EpollHookSource final : public detail::EventSource {
 public:
  EpollHookSource(std::weak_ptr<EpollEventLoop::Impl> loop, std::shared_ptr<Hook> hook)
      : m_loop{std::move(loop)}, m_hook{std::move(hook)} {}
  ~EpollHookSource() override { EpollHookSource::close(); }
  EpollHookSource(const EpollHookSource&) = delete;
  EpollHookSource& operator=(const EpollHookSource&) = delete;
  EpollHookSource(EpollHookSource&&) = delete;
  EpollHookSource& operator=(EpollHookSource&&) = delete;
  void close() noexcept override {
    if (!m_hook) return;
    if (auto l = m_loop.lock()) l->remove_hook(m_hook);
    m_hook.reset();
  }

 private:
  std::weak_ptr<EpollEventLoop::Impl> m_loop;
  std::shared_ptr<Hook> m_hook;
};

}  // namespace

namespace {
EpollEventLoop::Options options_from_environment() {
  EpollEventLoop::Options options;
  if (const auto value =
          detail::microseconds_from_environment("NETIO3_BUSY_POLL_US", "event loop")) {
    options.busy_poll = *value;
  }
  if (const auto value =
          detail::microseconds_from_environment("NETIO3_BUSY_POLL_FD_INTERVAL_US", "event loop")) {
    options.busy_poll_fd_interval = *value;
  }
  return options;
}
}  // namespace

EpollEventLoop::EpollEventLoop() : EpollEventLoop(options_from_environment()) {}

EpollEventLoop::EpollEventLoop(Options options) : m_impl{std::make_shared<Impl>(options)} {}

EpollEventLoop::~EpollEventLoop() {
  if (m_impl->is_running()) {
    NETIO3_ERROR("EpollEventLoop destroyed while run() is active; call stop() and join first");
  }
}

void EpollEventLoop::run() {
  m_impl->run();
}
void EpollEventLoop::stop() noexcept {
  m_impl->stop();
}
bool EpollEventLoop::is_running() const noexcept {
  return m_impl->is_running();
}
bool EpollEventLoop::in_loop_thread() const noexcept {
  return m_impl->in_loop_thread();
}
void EpollEventLoop::post(std::function<void()> fn) {
  m_impl->post(std::move(fn));
}
void EpollEventLoop::run_sync(std::function<void()> fn) {
  m_impl->run_sync(std::move(fn));
}
bool EpollEventLoop::polling() const noexcept {
  return m_impl->polling();
}

std::uint64_t EpollEventLoop::wakeups() const noexcept {
  return m_impl->wakeups();
}

void EpollEventLoop::attach() {
  m_impl->attach();
}
int EpollEventLoop::fd() const noexcept {
  return m_impl->fd();
}
bool EpollEventLoop::run_once() {
  return m_impl->run_once();
}
void EpollEventLoop::detach() {
  m_impl->detach();
}

FdHandle EpollEventLoop::add_fd(int fd, std::uint32_t events, FdCallback callback) {
  if (fd < 0) throw std::invalid_argument("EpollEventLoop::add_fd: negative fd");
  auto reg = m_impl->add(fd, events, std::move(callback), false);
  return FdHandle{std::make_shared<EpollFdSource>(m_impl, std::move(reg))};
}

EventSignalHandle EpollEventLoop::create_signal(std::function<void()> callback) {
  return create_signal(std::move(callback), false);
}

EventSignalHandle EpollEventLoop::create_signal(std::function<void()> callback, bool semaphore) {
  const int efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | (semaphore ? EFD_SEMAPHORE : 0));
  if (efd < 0) throw_errno("eventfd");
  FdCallback on_ready = [efd, cb = std::move(callback)](std::uint32_t) {
    std::uint64_t count = 0;
    if (::read(efd, &count, sizeof(count)) != static_cast<ssize_t>(sizeof(count))) return;
    cb();
  };
  // The registration owns the eventfd (closes it when destroyed, also if add() throws).
  auto reg = m_impl->add(efd, EPOLLIN, std::move(on_ready), true);
  return EventSignalHandle{std::make_shared<EpollSignalSource>(m_impl, std::move(reg))};
}

EventTimerHandle EpollEventLoop::create_timer(std::function<void()> callback) {
  const int tfd = ::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (tfd < 0) throw_errno("timerfd_create");
  FdCallback on_ready = [tfd, cb = std::move(callback)](std::uint32_t) {
    std::uint64_t expirations = 0;
    // EAGAIN: the timer was stopped or re-armed after it fired; nothing to report.
    if (::read(tfd, &expirations, sizeof(expirations)) !=
        static_cast<ssize_t>(sizeof(expirations))) {
      return;
    }
    cb();
  };
  auto reg = m_impl->add(tfd, EPOLLIN, std::move(on_ready), true);
  return EventTimerHandle{std::make_shared<EpollTimerSource>(m_impl, std::move(reg))};
}

namespace {
PrepareHookHandle register_hook(const std::shared_ptr<EpollEventLoop::Impl>& impl, PrepareHook hook,
                                bool polls_transport) {
  auto shared = std::make_shared<Hook>(std::move(hook), polls_transport);
  impl->add_hook(shared);
  return PrepareHookHandle{std::make_shared<EpollHookSource>(impl, std::move(shared))};
}
}  // namespace

PrepareHookHandle EpollEventLoop::add_prepare_hook(PrepareHook hook) {
  return register_hook(m_impl, std::move(hook), false);
}

PrepareHookHandle EpollEventLoop::add_polling_hook(PrepareHook hook) {
  return register_hook(m_impl, std::move(hook), true);
}

}  // namespace netio3
