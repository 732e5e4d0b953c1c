#pragma once

// Shared test tools. Every wait has a deadline and waits on a condition variable that the
// callbacks notify; nothing sleeps to synchronise.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <netio3/netio3.hpp>

namespace netio3::test {

using namespace std::chrono_literals;

// Generous: sanitizer builds on a loaded 2-core CI machine are slow. A passing test never
// waits this long; only a broken one does.
inline constexpr std::chrono::milliseconds DEFAULT_TIMEOUT = 30s;

// Built with ASan or TSan. Memory bounds differ there: ASan keeps freed blocks in quarantine,
// and both sanitizers' shadow memory grows with what the process touches.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool SANITIZED = true;
#else
inline constexpr bool SANITIZED = false;
#endif
// Built with TSan: its shadow memory is several times what the process touches.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool THREAD_SANITIZED = true;
#else
inline constexpr bool THREAD_SANITIZED = false;
#endif

// The local IP address tests listen on and connect to: NETIO3_TEST_ADDRESS, default
// 127.0.0.1 (on a verbs host, the address of an RDMA-capable interface).
[[nodiscard]] const std::string& test_address();

// The network mode the suites use with a backend: NetworkMode::TCP, but for UCX the value of
// NETIO3_TEST_UCX_MODE ("tcp" or "rdma"), so that ctest runs the conformance and reliability
// suites once more with UCX's shared-memory and RDMA transports (tests/CMakeLists.txt).
[[nodiscard]] NetworkMode mode_for(BackendType type);

// Number of open file descriptors of this process (/proc/self/fd).
[[nodiscard]] std::size_t open_fd_count();
// Resident set size of this process in bytes (/proc/self/statm).
[[nodiscard]] std::size_t rss_bytes();
// Virtual size of this process in bytes (/proc/self/statm): memory allocated counts here
// before it is touched.
[[nodiscard]] std::size_t virtual_bytes();

// Re-checks `pred` until it holds or `timeout` passes. Only for what nothing notifies about
// (descriptor counts, another process's state, a log file); everything else waits on a
// condition variable or poll().
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  return true;
}

// Captures netio3's log for its lifetime, then restores the default sink and the level. The
// level is lowered to `level` if it was higher, so that lines of that level are formatted.
class LogCapture {
 public:
  explicit LogCapture(LogLevel level = LogLevel::info);
  ~LogCapture();
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  LogCapture(LogCapture&&) = delete;
  LogCapture& operator=(LogCapture&&) = delete;

  // Lines of `level` or above that contain `needle`.
  [[nodiscard]] std::size_t count(std::string_view needle, LogLevel level = LogLevel::trace) const;
  // Waits (DEFAULT_TIMEOUT) until count(needle, level) >= n.
  [[nodiscard]] bool wait(std::string_view needle, std::size_t n, LogLevel level = LogLevel::trace);
  // Every line captured, each followed by a newline (for failure messages).
  [[nodiscard]] std::string text() const;

 private:
  struct State;
  LogLevel m_previous;
  std::shared_ptr<State> m_state;  // shared with the sink, which may outlive a late call
};

// Raises the soft RLIMIT_NOFILE to at least `want` (within the hard limit) for the scope.
class DescriptorLimit {
 public:
  explicit DescriptorLimit(std::size_t want);
  ~DescriptorLimit();
  DescriptorLimit(const DescriptorLimit&) = delete;
  DescriptorLimit& operator=(const DescriptorLimit&) = delete;
  DescriptorLimit(DescriptorLimit&&) = delete;
  DescriptorLimit& operator=(DescriptorLimit&&) = delete;
  // The soft limit now in force.
  [[nodiscard]] std::size_t have() const { return m_have; }

 private:
  std::size_t m_saved_soft{0};
  std::size_t m_have{0};
};

// A plain TCP socket listening on 127.0.0.1 at a port the OS chose. It accepts nothing by
// itself (connections stay in its backlog): a peer that never speaks. Closed on destruction.
class RawListener {
 public:
  RawListener();
  ~RawListener();
  RawListener(const RawListener&) = delete;
  RawListener& operator=(const RawListener&) = delete;
  RawListener(RawListener&&) = delete;
  RawListener& operator=(RawListener&&) = delete;

  [[nodiscard]] EndPointAddress address() const { return {"127.0.0.1", m_port}; }
  [[nodiscard]] int fd() const { return m_fd; }

 private:
  int m_fd{-1};
  std::uint16_t m_port{0};
};

// A port on 127.0.0.1 that nobody listens on: bound by the OS, read back, released. Another
// process (a test running beside this one) may take it at once: where nothing may listen on a
// port while a test uses it, hold a BoundSocket instead.
[[nodiscard]] std::uint16_t unused_port();

// Runs an EpollEventLoop on its own thread; the constructor returns once the loop is
// dispatching. Stops and joins on destruction.
class LoopThread {
 public:
  LoopThread();
  ~LoopThread();
  LoopThread(const LoopThread&) = delete;
  LoopThread& operator=(const LoopThread&) = delete;
  LoopThread(LoopThread&&) = delete;
  LoopThread& operator=(LoopThread&&) = delete;

  [[nodiscard]] const std::shared_ptr<EpollEventLoop>& loop() const { return m_loop; }
  void stop();

 private:
  std::shared_ptr<EpollEventLoop> m_loop;
  std::jthread m_thread;
};

// Records every callback of a backend, in order, and lets a test wait for conditions on
// what was recorded.
class Recorder {
 public:
  // READY: on_ready_to_send_cb.
  enum class Kind { ESTABLISHED, CLOSED, REFUSED, COMPLETED, DATA, READY };
  // Which of the callback variants config() sets: the documented on_data_cb,
  // on_connection_refused_cb and on_connection_closed_cb, or on_data_from_cb,
  // on_connection_refused_reason_cb and on_connection_closed_reason_cb.
  enum class Callbacks { DOCUMENTED, WITH_SENDER_AND_REASON };
  struct Event {
    Kind kind{};
    // Empty for DATA with Callbacks::DOCUMENTED (on_data_cb has no address).
    EndPointAddress remote{};
    std::uint64_t key{};                // COMPLETED
    std::vector<std::uint64_t> keys{};  // CLOSED
    EndpointCapabilities caps{};        // ESTABLISHED
    std::size_t size{};                 // DATA
    std::thread::id thread{};
    RefusalReason refusal{};  // REFUSED with Callbacks::WITH_SENDER_AND_REASON
    CloseReason closed{};     // CLOSED with Callbacks::WITH_SENDER_AND_REASON
  };

  // A NetworkConfig whose callbacks all feed this recorder. `on_data` (optional) is
  // called on the loop thread after the message was recorded, e.g. to echo it.
  [[nodiscard]] NetworkConfig config(ThreadSafetyModel model = ThreadSafetyModel::SAFE,
                                     NetworkMode mode = NetworkMode::TCP,
                                     Callbacks callbacks = Callbacks::DOCUMENTED);

  // Called after every recorded event, outside the recorder's lock, on the loop thread.
  void set_hook(std::function<void(const Event&, std::span<const std::uint8_t>)> hook);

  // A buffer from get_buffer lives until its connection's closed callback. A test thread
  // that fills buffers while a connection may close (SAFE model) holds this guard from
  // get_buffer to send_buffer; every closed callback takes it exclusively first, so the
  // connection cannot go away in between.
  [[nodiscard]] std::shared_lock<std::shared_mutex> hold_buffers() {
    return std::shared_lock{m_buffer_guard};
  }

  // Keep copies of received messages (off by default: large tests only count).
  void keep_data(bool keep) { m_keep_data = keep; }

  // Waits until pred(*this) holds (evaluated under the recorder's lock).
  bool wait(const std::function<bool(const Recorder&)>& pred,
            std::chrono::milliseconds timeout = DEFAULT_TIMEOUT);

  // Accessors; call them only inside wait() predicates or after a wait returned, or use
  // the snapshot() copy.
  [[nodiscard]] const std::vector<Event>& events() const { return m_events; }
  [[nodiscard]] const std::vector<std::vector<std::uint8_t>>& messages() const { return m_data; }
  [[nodiscard]] std::size_t count(Kind kind) const;
  [[nodiscard]] std::size_t count(Kind kind, const EndPointAddress& remote) const;
  // count() under the recorder's lock, for use outside wait() while events may still come.
  [[nodiscard]] std::size_t count_now(Kind kind) const;
  [[nodiscard]] std::size_t count_now(Kind kind, const EndPointAddress& remote) const;
  [[nodiscard]] std::vector<Event> snapshot() const;
  [[nodiscard]] std::vector<std::vector<std::uint8_t>> messages_snapshot() const;
  [[nodiscard]] std::uint64_t bytes_received() const;

 private:
  void record(Event event, std::span<const std::uint8_t> bytes);

  mutable std::mutex m_mutex;
  std::shared_mutex m_buffer_guard;
  std::condition_variable m_cv;
  std::vector<Event> m_events;
  std::vector<std::vector<std::uint8_t>> m_data;
  std::uint64_t m_bytes{0};
  bool m_keep_data{true};
  std::function<void(const Event&, std::span<const std::uint8_t>)> m_hook;
};

// A TCP socket bound, with SO_REUSEADDR, to `address` (port 0: one the kernel picks), not
// listening: the kernel gives no other socket of this host its port for a bind to port 0
// while it lives. With `in_use_is_held`, a port that another socket already holds (EADDRINUSE)
// counts as held too. error() says why it could not bind (empty when it could).
class BoundSocket {
 public:
  explicit BoundSocket(const EndPointAddress& address, bool in_use_is_held = false);
  ~BoundSocket();
  BoundSocket(const BoundSocket&) = delete;
  BoundSocket& operator=(const BoundSocket&) = delete;
  BoundSocket(BoundSocket&&) = delete;
  BoundSocket& operator=(BoundSocket&&) = delete;

  [[nodiscard]] int fd() const noexcept { return m_fd; }
  [[nodiscard]] std::uint16_t port() const noexcept { return m_port; }
  [[nodiscard]] const std::string& error() const noexcept { return m_error; }

 private:
  int m_fd{-1};
  std::uint16_t m_port{0};
  std::string m_error;
};

// A deterministic byte pattern for message `index` of `size` bytes, and its check.
[[nodiscard]] std::vector<std::uint8_t> pattern(std::uint64_t index, std::size_t size);
[[nodiscard]] bool matches_pattern(std::span<const std::uint8_t> bytes, std::uint64_t index);

}  // namespace netio3::test

// ---- Child processes ---------------------------------------------------------------------

#include <optional>
#include <poll.h>
#include <span>
#include <sys/types.h>
#include <utility>

namespace netio3::test {

// A child process (posix_spawnp, the caller's environment) with stdin on /dev/null and its
// stdout and stderr on pipes, read with poll() and a deadline. The destructor kills
// (SIGKILL, which also ends a stopped child) and reaps a child that is still running, so no
// child outlives its test.
class ChildProcess {
 public:
  using Clock = std::chrono::steady_clock;
  // Generous: a sanitizer build on a loaded two-core machine is slow. Passing tests never
  // get near it.
  static constexpr std::chrono::seconds DEFAULT_CHILD_TIMEOUT{60};

  // args[0] is the program: a path, or a name looked up in PATH. Throws std::system_error if
  // it cannot be started.
  explicit ChildProcess(std::vector<std::string> args);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ChildProcess(ChildProcess&&) = delete;
  ChildProcess& operator=(ChildProcess&&) = delete;

  // Reads output until pred(stdout so far) holds; false if the child closed stdout or the
  // deadline passed first.
  bool read_until(const std::function<bool(const std::string&)>& pred, Clock::time_point deadline);

  // Reads the output of several children at once until pred() holds (it may look at their
  // out()); false when the deadline passed or all of them closed their output first.
  static bool read_until(std::span<ChildProcess* const> children, const std::function<bool()>& pred,
                         Clock::time_point deadline);

  // Reads all output and waits for the exit; kills the child at the deadline. Returns the
  // exit status, or nullopt if the child was killed or died from a signal.
  std::optional<int> wait(Clock::time_point deadline);
  std::optional<int> wait() { return wait(Clock::now() + DEFAULT_CHILD_TIMEOUT); }

  // Sends a signal (nothing once the child was reaped).
  void signal(int signo) const;
  // SIGSTOP, and returns once the kernel reports the child stopped (true) or exited (false).
  bool stop();

  [[nodiscard]] const std::string& out() const { return m_out.text; }
  [[nodiscard]] const std::string& err() const { return m_err.text; }
  [[nodiscard]] pid_t pid() const { return m_pid; }
  [[nodiscard]] bool exited() const { return m_exited; }
  // The signal that ended the child, if one did.
  [[nodiscard]] std::optional<int> term_signal() const;

  // Command, status and all output, for failure messages.
  [[nodiscard]] std::string describe() const;

 private:
  struct Stream {
    int fd{-1};
    std::string text;
  };

  // Adds this child's open fds (and its pidfd while it runs) to a poll set.
  void add_to(std::vector<pollfd>& fds, std::vector<std::pair<ChildProcess*, int>>& owners);
  // Handles the readiness of one of its fds.
  void handle(int fd);
  static void pump(std::span<ChildProcess* const> children, Clock::time_point deadline);
  void reap(int options);
  void kill_and_reap();

  std::vector<std::string> m_args;
  pid_t m_pid{-1};
  int m_pidfd{-1};
  Stream m_out;
  Stream m_err;
  bool m_exited{false};
  bool m_timed_out{false};
  int m_status{0};
};

}  // namespace netio3::test
