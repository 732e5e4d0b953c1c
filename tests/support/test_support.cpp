#include "test_support.hpp"

#include <arpa/inet.h>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <future>
#include <netinet/in.h>
#include <stdexcept>
#include <sys/resource.h>
#include <sys/socket.h>
#include <system_error>
#include <tuple>
#include <unistd.h>

namespace netio3::test {

BoundSocket::BoundSocket(const EndPointAddress& address, bool in_use_is_held)
    : m_fd{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)} {
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_port = htons(address.port);
  socklen_t len = sizeof(in);
  const int one = 1;
  if (m_fd < 0 || ::inet_pton(AF_INET, address.address.c_str(), &in.sin_addr) != 1 ||
      ::setsockopt(m_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
    m_error = std::strerror(errno);
    return;
  }
  if (::bind(m_fd, reinterpret_cast<const sockaddr*>(&in), sizeof(in)) != 0) {  // NOLINT
    if (errno == EADDRINUSE && in_use_is_held) {
      m_port = address.port;
    } else {
      m_error = std::strerror(errno);
    }
    return;
  }
  if (::getsockname(m_fd, reinterpret_cast<sockaddr*>(&in), &len) != 0) {  // NOLINT
    m_error = std::strerror(errno);
    return;
  }
  m_port = ntohs(in.sin_port);
}

BoundSocket::~BoundSocket() {
  if (m_fd >= 0) ::close(m_fd);
}

struct LogCapture::State {
  mutable std::mutex mutex;
  std::condition_variable cv;
  std::vector<std::pair<LogLevel, std::string>> lines;

  [[nodiscard]] std::size_t count_locked(std::string_view needle, LogLevel level) const {
    return static_cast<std::size_t>(std::count_if(lines.begin(), lines.end(), [&](const auto& l) {
      return l.first >= level && l.second.find(needle) != std::string::npos;
    }));
  }
};

LogCapture::LogCapture(LogLevel level)
    : m_previous{log_level()}, m_state{std::make_shared<State>()} {
  set_log_sink([state = m_state](LogLevel at, std::string_view message) {
    {
      const std::lock_guard lock{state->mutex};
      state->lines.emplace_back(at, std::string{message});
    }
    state->cv.notify_all();
  });
  if (m_previous > level) set_log_level(level);
}

LogCapture::~LogCapture() {
  set_log_level(m_previous);
  set_log_sink({});
}

std::size_t LogCapture::count(std::string_view needle, LogLevel level) const {
  const std::lock_guard lock{m_state->mutex};
  return m_state->count_locked(needle, level);
}

bool LogCapture::wait(std::string_view needle, std::size_t n, LogLevel level) {
  std::unique_lock lock{m_state->mutex};
  return m_state->cv.wait_for(lock, DEFAULT_TIMEOUT,
                              [&] { return m_state->count_locked(needle, level) >= n; });
}

std::string LogCapture::text() const {
  const std::lock_guard lock{m_state->mutex};
  std::string out;
  for (const auto& line : m_state->lines) out += line.second + "\n";
  return out;
}

DescriptorLimit::DescriptorLimit(std::size_t want) {
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  m_saved_soft = static_cast<std::size_t>(limit.rlim_cur);
  if (limit.rlim_cur < want) {
    limit.rlim_cur = std::min(static_cast<rlim_t>(want), limit.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
  ::getrlimit(RLIMIT_NOFILE, &limit);
  m_have = static_cast<std::size_t>(limit.rlim_cur);
}

DescriptorLimit::~DescriptorLimit() {
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  limit.rlim_cur = static_cast<rlim_t>(m_saved_soft);
  ::setrlimit(RLIMIT_NOFILE, &limit);
}

NetworkMode mode_for(BackendType type) {
  if (type != BackendType::UCX) return NetworkMode::TCP;
  const char* env = std::getenv("NETIO3_TEST_UCX_MODE");
  if (env == nullptr || *env == '\0') return NetworkMode::TCP;
  const auto mode = parse_network_mode(env);
  if (!mode)
    throw std::invalid_argument(fmt::format("NETIO3_TEST_UCX_MODE={}: not tcp or rdma", env));
  return *mode;
}

const std::string& test_address() {
  static const std::string address = [] {
    const char* env = std::getenv("NETIO3_TEST_ADDRESS");
    return std::string{env != nullptr && *env != '\0' ? env : "127.0.0.1"};
  }();
  return address;
}

std::size_t open_fd_count() {
  std::size_t n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n - 1;  // the DIR's own descriptor
}

std::size_t rss_bytes() {
  std::ifstream statm{"/proc/self/statm"};
  std::size_t pages_total = 0;
  std::size_t pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

std::size_t virtual_bytes() {
  std::ifstream statm{"/proc/self/statm"};
  std::size_t pages_total = 0;
  statm >> pages_total;
  return pages_total * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

namespace {

// Binds a TCP socket to 127.0.0.1:0 (listening if `listen`); returns the fd and the port.
std::pair<int, std::uint16_t> bind_loopback(bool listen) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  auto* generic = reinterpret_cast<sockaddr*>(&addr);  // NOLINT(*-reinterpret-cast): BSD API
  if (::bind(fd, generic, sizeof(addr)) != 0 || (listen && ::listen(fd, 16) != 0) ||
      ::getsockname(fd, generic, &len) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::system_error(err, std::generic_category(), "bind/listen on 127.0.0.1:0");
  }
  return {fd, ntohs(addr.sin_port)};
}

}  // namespace

RawListener::RawListener() {
  std::tie(m_fd, m_port) = bind_loopback(true);
}

RawListener::~RawListener() {
  ::close(m_fd);
}

std::uint16_t unused_port() {
  const auto [fd, port] = bind_loopback(false);
  ::close(fd);
  return port;
}

LoopThread::LoopThread()
    : m_loop{std::make_shared<EpollEventLoop>()}, m_thread{[loop = m_loop] { loop->run(); }} {
  // Return only once run() dispatches: otherwise a run_sync() right after construction
  // would run inline on the caller (the loop "is not running" yet) and race with it.
  std::promise<void> running;
  auto started = running.get_future();
  m_loop->post([&running] { running.set_value(); });
  if (started.wait_for(DEFAULT_TIMEOUT) != std::future_status::ready) {
    throw std::runtime_error("LoopThread: the event loop did not start");
  }
}

LoopThread::~LoopThread() {
  stop();
}

void LoopThread::stop() {
  if (!m_thread.joinable()) return;
  m_loop->stop();
  m_thread.join();
}

NetworkConfig Recorder::config(ThreadSafetyModel model, NetworkMode mode, Callbacks callbacks) {
  NetworkConfig config{.mode = mode, .thread_safety = model};
  if (callbacks == Callbacks::DOCUMENTED) {
    config.on_data_cb = [this](std::span<const std::uint8_t> data) {
      record(Event{.kind = Kind::DATA, .size = data.size()}, data);
    };
    config.on_connection_refused_cb = [this](const EndPointAddress& remote) {
      record(Event{.kind = Kind::REFUSED, .remote = remote}, {});
    };
  } else {
    config.on_data_from_cb = [this](const EndPointAddress& remote,
                                    std::span<const std::uint8_t> data) {
      record(Event{.kind = Kind::DATA, .remote = remote, .size = data.size()}, data);
    };
    config.on_connection_refused_reason_cb = [this](const EndPointAddress& remote,
                                                    const RefusalReason& reason) {
      record(Event{.kind = Kind::REFUSED, .remote = remote, .refusal = reason}, {});
    };
  }
  config.on_connection_established_cb = [this](const EndPointAddress& remote,
                                               EndpointCapabilities caps) {
    record(Event{.kind = Kind::ESTABLISHED, .remote = remote, .caps = caps}, {});
  };
  if (callbacks == Callbacks::DOCUMENTED) {
    config.on_connection_closed_cb = [this](const EndPointAddress& remote,
                                            const std::vector<std::uint64_t>& keys) {
      { const std::unique_lock wait_for_buffer_users{m_buffer_guard}; }
      record(Event{.kind = Kind::CLOSED, .remote = remote, .keys = keys}, {});
    };
  } else {
    config.on_connection_closed_reason_cb = [this](const EndPointAddress& remote,
                                                   const std::vector<std::uint64_t>& keys,
                                                   const CloseReason& reason) {
      { const std::unique_lock wait_for_buffer_users{m_buffer_guard}; }
      record(Event{.kind = Kind::CLOSED, .remote = remote, .keys = keys, .closed = reason}, {});
    };
  }
  config.on_send_completed_cb = [this](const EndPointAddress& remote, std::uint64_t key) {
    record(Event{.kind = Kind::COMPLETED, .remote = remote, .key = key}, {});
  };
  config.on_ready_to_send_cb = [this](const EndPointAddress& remote) {
    record(Event{.kind = Kind::READY, .remote = remote}, {});
  };
  return config;
}

void Recorder::set_hook(std::function<void(const Event&, std::span<const std::uint8_t>)> hook) {
  const std::lock_guard lock{m_mutex};
  m_hook = std::move(hook);
}

void Recorder::record(Event event, std::span<const std::uint8_t> bytes) {
  event.thread = std::this_thread::get_id();
  std::function<void(const Event&, std::span<const std::uint8_t>)> hook;
  {
    const std::lock_guard lock{m_mutex};
    if (event.kind == Kind::DATA) {
      m_bytes += bytes.size();
      if (m_keep_data) m_data.emplace_back(bytes.begin(), bytes.end());
    }
    m_events.push_back(event);
    hook = m_hook;
  }
  m_cv.notify_all();
  if (hook) hook(event, bytes);
}

bool Recorder::wait(const std::function<bool(const Recorder&)>& pred,
                    std::chrono::milliseconds timeout) {
  std::unique_lock lock{m_mutex};
  return m_cv.wait_for(lock, timeout, [&] { return pred(*this); });
}

std::size_t Recorder::count(Kind kind) const {
  std::size_t n = 0;
  for (const auto& e : m_events) n += e.kind == kind ? 1 : 0;
  return n;
}

std::size_t Recorder::count(Kind kind, const EndPointAddress& remote) const {
  std::size_t n = 0;
  for (const auto& e : m_events) n += (e.kind == kind && e.remote == remote) ? 1 : 0;
  return n;
}

std::size_t Recorder::count_now(Kind kind) const {
  const std::lock_guard lock{m_mutex};
  return count(kind);
}

std::size_t Recorder::count_now(Kind kind, const EndPointAddress& remote) const {
  const std::lock_guard lock{m_mutex};
  return count(kind, remote);
}

std::vector<Recorder::Event> Recorder::snapshot() const {
  const std::lock_guard lock{m_mutex};
  return m_events;
}

std::vector<std::vector<std::uint8_t>> Recorder::messages_snapshot() const {
  const std::lock_guard lock{m_mutex};
  return m_data;
}

std::uint64_t Recorder::bytes_received() const {
  const std::lock_guard lock{m_mutex};
  return m_bytes;
}

std::vector<std::uint8_t> pattern(std::uint64_t index, std::size_t size) {
  std::vector<std::uint8_t> out(size);
  std::uint64_t x = index * 0x9E3779B97F4A7C15ULL + 1;
  for (std::size_t i = 0; i < size; ++i) {
    x ^= x << 13U;
    x ^= x >> 7U;
    x ^= x << 17U;
    out[i] = static_cast<std::uint8_t>(x);
  }
  return out;
}

bool matches_pattern(std::span<const std::uint8_t> bytes, std::uint64_t index) {
  const auto expected = pattern(index, bytes.size());
  return std::equal(bytes.begin(), bytes.end(), expected.begin());
}

}  // namespace netio3::test

// ---- Child processes ---------------------------------------------------------------------

#include <algorithm>
#include <array>
#include <csignal>
#include <fcntl.h>
#include <spawn.h>
#include <sstream>
#include <sys/syscall.h>
#include <sys/wait.h>

extern char** environ;  // NOLINT: POSIX

namespace netio3::test {

namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

}  // namespace

ChildProcess::ChildProcess(std::vector<std::string> args) : m_args{std::move(args)} {
  if (m_args.empty()) throw std::invalid_argument("ChildProcess: no program");
  std::array<int, 2> out{-1, -1};
  std::array<int, 2> err{-1, -1};
  if (::pipe2(out.data(), O_CLOEXEC) != 0) throw_errno("pipe2");
  if (::pipe2(err.data(), O_CLOEXEC) != 0) {
    const int saved = errno;
    ::close(out[0]);
    ::close(out[1]);
    errno = saved;
    throw_errno("pipe2");
  }
  posix_spawn_file_actions_t actions{};
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);  // dup2 clears O_CLOEXEC
  posix_spawn_file_actions_adddup2(&actions, err[1], 2);
  std::vector<char*> argv;
  argv.reserve(m_args.size() + 1);
  for (auto& arg : m_args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  const int rc = ::posix_spawnp(&m_pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  ::close(err[1]);
  if (rc != 0) {
    ::close(out[0]);
    ::close(err[0]);
    throw std::system_error(rc, std::generic_category(), "posix_spawn " + m_args[0]);
  }
  m_out.fd = out[0];
  m_err.fd = err[0];
  // A pidfd becomes readable when the child exits, so poll() can wait for the exit too.
  m_pidfd = static_cast<int>(::syscall(SYS_pidfd_open, m_pid, 0));
  if (m_pidfd < 0) {
    const int saved = errno;
    kill_and_reap();
    ::close(m_out.fd);
    ::close(m_err.fd);
    errno = saved;
    throw_errno("pidfd_open");
  }
}

ChildProcess::~ChildProcess() {
  kill_and_reap();
  for (const int fd : {m_out.fd, m_err.fd, m_pidfd}) {
    if (fd >= 0) ::close(fd);
  }
}

bool ChildProcess::read_until(const std::function<bool(const std::string&)>& pred,
                              Clock::time_point deadline) {
  ChildProcess* self = this;
  return read_until(
      std::span<ChildProcess* const>{&self, 1}, [&] { return pred(m_out.text); }, deadline);
}

bool ChildProcess::read_until(std::span<ChildProcess* const> children,
                              const std::function<bool()>& pred, Clock::time_point deadline) {
  while (!pred()) {
    const bool any_open = std::any_of(children.begin(), children.end(),
                                      [](const ChildProcess* c) { return c->m_out.fd >= 0; });
    if (!any_open || Clock::now() >= deadline) return false;
    pump(children, deadline);
  }
  return true;
}

std::optional<int> ChildProcess::wait(Clock::time_point deadline) {
  ChildProcess* self = this;
  while (m_out.fd >= 0 || m_err.fd >= 0 || !m_exited) {
    if (Clock::now() >= deadline) {
      m_timed_out = true;
      kill_and_reap();
      return std::nullopt;
    }
    pump(std::span<ChildProcess* const>{&self, 1}, deadline);
  }
  if (WIFEXITED(m_status)) return WEXITSTATUS(m_status);
  return std::nullopt;
}

void ChildProcess::signal(int signo) const {
  if (!m_exited && m_pid > 0) ::kill(m_pid, signo);
}

bool ChildProcess::stop() {
  if (m_exited) return false;
  ::kill(m_pid, SIGSTOP);
  // WNOWAIT: only look; an exit stays to be reaped by reap(). SIGSTOP cannot be caught, so
  // this returns as soon as the kernel has stopped (or buried) the child.
  siginfo_t info{};
  while (::waitid(P_PID, static_cast<id_t>(m_pid), &info, WSTOPPED | WEXITED | WNOWAIT) != 0) {
    if (errno != EINTR) throw_errno("waitid");
  }
  return info.si_code == CLD_STOPPED;
}

std::optional<int> ChildProcess::term_signal() const {
  if (m_exited && WIFSIGNALED(m_status)) return WTERMSIG(m_status);
  return std::nullopt;
}

std::string ChildProcess::describe() const {
  std::ostringstream s;
  s << "command:";
  for (const auto& arg : m_args) s << ' ' << arg;
  s << "\nstatus: ";
  if (m_timed_out) {
    s << "killed after the deadline";
  } else if (!m_exited) {
    s << "running";
  } else if (WIFEXITED(m_status)) {
    s << "exit " << WEXITSTATUS(m_status);
  } else if (WIFSIGNALED(m_status)) {
    s << "signal " << WTERMSIG(m_status);
  }
  s << "\n--- stdout ---\n" << m_out.text << "--- stderr ---\n" << m_err.text << "---";
  return s.str();
}

void ChildProcess::add_to(std::vector<pollfd>& fds,
                          std::vector<std::pair<ChildProcess*, int>>& owners) {
  for (const int fd : {m_out.fd, m_err.fd, m_exited ? -1 : m_pidfd}) {
    if (fd < 0) continue;
    fds.push_back(pollfd{.fd = fd, .events = POLLIN, .revents = 0});
    owners.emplace_back(this, fd);
  }
}

void ChildProcess::handle(int fd) {
  if (fd == m_pidfd) {
    reap(0);  // readable pidfd: the child has exited, waitpid does not block
    return;
  }
  Stream& stream = fd == m_out.fd ? m_out : m_err;
  std::array<char, 4096> buffer{};
  const ssize_t got = ::read(stream.fd, buffer.data(), buffer.size());
  if (got > 0) {
    stream.text.append(buffer.data(), static_cast<std::size_t>(got));
  } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
    ::close(stream.fd);
    stream.fd = -1;
  }
}

// One poll() round over all children: reads what is there, notices EOF and exits.
void ChildProcess::pump(std::span<ChildProcess* const> children, Clock::time_point deadline) {
  std::vector<pollfd> fds;
  std::vector<std::pair<ChildProcess*, int>> owners;
  for (ChildProcess* child : children) child->add_to(fds, owners);
  if (fds.empty()) return;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  const int timeout_ms = static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 60'000));
  const int rc = ::poll(fds.data(), fds.size(), timeout_ms);
  if (rc < 0) {
    if (errno == EINTR) return;
    throw_errno("poll");
  }
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents != 0) owners[i].first->handle(owners[i].second);
  }
}

void ChildProcess::reap(int options) {
  if (m_exited) return;
  int status = 0;
  const pid_t rc = ::waitpid(m_pid, &status, options);
  if (rc == m_pid) {
    m_exited = true;
    m_status = status;
  }
}

void ChildProcess::kill_and_reap() {
  if (m_exited || m_pid <= 0) return;
  ::kill(m_pid, SIGKILL);
  reap(0);  // SIGKILL cannot be ignored, also not by a stopped child: this returns at once
}

}  // namespace netio3::test
