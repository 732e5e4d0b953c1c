// netio3-bench-idle: what idle connections cost, for every backend compiled in.
//
//  1. "An idle loop uses no CPU": with N connections open and no traffic, the process's CPU
//     time (getrusage, user + sys) and the event loop's wake-ups (BaseEventLoop::wakeups())
//     over a window of --idle-seconds; also the CPU time of the loop thread alone and the
//     context switches of the transport's own threads (UCX's async thread).
//  2. "A connection costs no receive memory beyond its pool": RSS, virtual size and open
//     fds after each count of --connections-list, and the growth per connection between
//     the first and the last count, for three receive set-ups (--recv):
//       own       the listener's connections get their own pool (recv_params num_buf x
//                 buf_size each);
//       shared    backend-wide shared receive buffers (NetworkConfig::shared_receive_buffers);
//       listener  one pool for all connections of the listener
//                 (recv_params.use_shared_receive_buffers on the listen endpoint).
//     The two shared set-ups exclude each other (InvalidConnectionParameters). The active
//     endpoints ask for no receive buffers of their own in every set-up, so the differences
//     between the set-ups are the accepted side's receive memory.
//
// One backend listens on 0.0.0.0 port 0 and connects to itself, as docs/ucx.md recommends
// for UCX (one worker per process); a "connection" below is such a pair: one active and one
// accepted endpoint, both in this process. netio3 names an active endpoint by the address
// it connects to, so every client needs an address of its own (--addressing):
//   ips    one listener; the clients connect to 127.0.0.1, 127.0.0.2, ... (all of 127/8 is
//          loopback), as tests/reliability/churn_test.cpp does;
//   ports  a listener per connection; the clients connect to 127.0.0.1:<its port>. For UCX:
//          UCX 1.13 accepts a connection only on an address of a network interface (its
//          tcp sockcm looks up the interface of the accepted socket's local address), so
//          127.0.0.2 and up are refused ("Endpoint is not connected"). What opening the
//          listeners adds is measured apart and left out of the growth per connection.
// The kernel picks a client's source port per destination, so two connections now and then
// share one (127.0.0.1:p to two destinations); the listener refuses the second, whose name
// (the peer's address) is taken. Such a set-up is tried again (--retries) and counted.
//
// Every backend/set-up runs in a child process of its own (this binary with --child):
// memory freed by one run would otherwise hide the growth of the next, the process CPU
// time belongs to one backend only, and a transport that aborts ends only its own run (the
// table then says how many connections had been established).
//
// Exit status: 0 when every run reached every connection count, 1 when a set-up failed
// (the table says how far it got and why), 2 for bad options.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sstream>
#include <string>
#include <string_view>
#include <sys/resource.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "json_text.hpp"

extern char** environ;  // NOLINT(readability-redundant-declaration): for posix_spawn

namespace {

using netio3::BackendType;
using netio3::EndPointAddress;
using netio3::tools::json_string;
using Clock = std::chrono::steady_clock;

constexpr int EXIT_SETUP_FAILED = 1;
constexpr int EXIT_USAGE = 2;
constexpr int RESULT_FD = 3;  // where a child writes its result lines

const char* const USAGE = R"(usage: netio3-bench-idle [options]
  --backend B[,B...]          asyncmsg, libfabric, ucx or all (default: all compiled in)
  --recv R[,R...]             receive set-ups: own, shared, listener or all (default all)
  --connections-list N[,N...] connection counts, increasing (default 10,1000)
  --idle-seconds S            idle window measured at each count (default 2)
  --settle-seconds S          wait before each window, so that timers armed for the set-up
                              (100 ms deadline checks) can stop (default 0.5)
  --buf-size BYTES            receive buffer size (default 65536)
  --num-buf N                 receive buffers per pool (default 8)
  --batch N                   connection set-ups in flight at once (default 64)
  --retries N                 times a refused set-up is tried again (default 5)
  --addressing A              ips: one listener, clients connect to 127.0.x.y; ports: one
                              listener per connection, clients connect to 127.0.0.1:<port>;
                              auto: ports for ucx (UCX 1.13 accepts only on interface
                              addresses), ips otherwise (default auto)
  --mode tcp|rdma              NetworkConfig::mode (default tcp; rdma: UCX picks shared memory)
  --setup-timeout S           per connection count (default 60)
  --json FILE                 append one JSON line per backend and receive set-up
A connection is a pair (active + accepted endpoint), both in this process; each
backend/set-up runs in a child process of its own.
exit status: 0 all counts reached, 1 a set-up failed, 2 bad options
)";

enum class Recv { OWN, SHARED, LISTENER };
enum class Addressing { AUTO, IPS, PORTS };

std::string_view to_string(Addressing addressing) {
  switch (addressing) {
    case Addressing::AUTO:
      return "auto";
    case Addressing::IPS:
      return "ips";
    case Addressing::PORTS:
      return "ports";
  }
  return "?";
}

std::string_view to_string(Recv recv) {
  switch (recv) {
    case Recv::OWN:
      return "own";
    case Recv::SHARED:
      return "shared";
    case Recv::LISTENER:
      return "listener";
  }
  return "?";
}

std::optional<Recv> parse_recv(std::string_view name) {
  for (const Recv r : {Recv::OWN, Recv::SHARED, Recv::LISTENER}) {
    if (name == to_string(r)) return r;
  }
  return std::nullopt;
}

struct Options {
  std::vector<BackendType> backends;
  std::vector<Recv> recvs{Recv::OWN, Recv::SHARED, Recv::LISTENER};
  std::vector<std::size_t> counts{10, 1000};
  double idle_seconds{2.0};
  double settle_seconds{0.5};
  std::size_t buf_size{64 * 1024};
  std::size_t num_buf{8};
  std::size_t batch{64};
  std::size_t retries{5};
  Addressing addressing{Addressing::AUTO};
  netio3::NetworkMode mode{netio3::NetworkMode::TCP};
  double setup_timeout{60.0};
  std::string json_path;
  bool child{false};
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::vector<std::string> split(std::string_view list) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    const auto comma = std::min(list.find(',', start), list.size());
    if (comma > start) out.emplace_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

template <typename T>
T parse_number(const std::string& option, const std::string& text) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc{} || ptr != end) {
    throw UsageError(fmt::format("{}: '{}' is not a number", option, text));
  }
  return value;
}

double parse_seconds(const std::string& option, const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !(value >= 0.0) || value > 3600.0) {
    throw UsageError(fmt::format("{}: '{}' is not a number of seconds (0..3600)", option, text));
  }
  return value;
}

Options parse_options(int argc, char** argv) {
  Options o;
  o.backends = netio3::Netio3Backend::available();
  const std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i];
    std::optional<std::string> inline_value;
    if (const auto eq = name.find('='); name.starts_with("--") && eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name.resize(eq);
    }
    if (name == "--help" || name == "-h") {
      std::fputs(USAGE, stdout);
      std::exit(0);  // NOLINT(concurrency-mt-unsafe): single-threaded here
    }
    if (name == "--child") {
      o.child = true;
      continue;
    }
    const auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= args.size()) throw UsageError(fmt::format("{} needs a value", name));
      return args[++i];
    };
    if (name == "--backend") {
      o.backends.clear();
      for (const auto& b : split(value())) {
        if (b == "all") {
          o.backends = netio3::Netio3Backend::available();
          continue;
        }
        const auto type = netio3::parse_backend_type(b);
        if (!type) throw UsageError(fmt::format("--backend: unknown backend '{}'", b));
        if (!netio3::Netio3Backend::is_available(*type)) {
          throw UsageError(fmt::format("--backend: '{}' is not compiled into this build", b));
        }
        o.backends.push_back(*type);
      }
    } else if (name == "--recv") {
      o.recvs.clear();
      for (const auto& r : split(value())) {
        if (r == "all") {
          o.recvs = {Recv::OWN, Recv::SHARED, Recv::LISTENER};
          continue;
        }
        const auto recv = parse_recv(r);
        if (!recv) throw UsageError(fmt::format("--recv: unknown set-up '{}'", r));
        o.recvs.push_back(*recv);
      }
    } else if (name == "--connections-list") {
      o.counts.clear();
      for (const auto& n : split(value())) o.counts.push_back(parse_number<std::size_t>(name, n));
    } else if (name == "--idle-seconds") {
      o.idle_seconds = parse_seconds(name, value());
    } else if (name == "--settle-seconds") {
      o.settle_seconds = parse_seconds(name, value());
    } else if (name == "--buf-size") {
      o.buf_size = parse_number<std::size_t>(name, value());
    } else if (name == "--num-buf") {
      o.num_buf = parse_number<std::size_t>(name, value());
    } else if (name == "--batch") {
      o.batch = parse_number<std::size_t>(name, value());
    } else if (name == "--retries") {
      o.retries = parse_number<std::size_t>(name, value());
    } else if (name == "--addressing") {
      const std::string a = value();
      if (a == "auto") {
        o.addressing = Addressing::AUTO;
      } else if (a == "ips") {
        o.addressing = Addressing::IPS;
      } else if (a == "ports") {
        o.addressing = Addressing::PORTS;
      } else {
        throw UsageError(fmt::format("--addressing: '{}' is not auto, ips or ports", a));
      }
    } else if (name == "--mode") {
      const auto mode = netio3::parse_network_mode(value());
      if (!mode) throw UsageError("--mode: tcp or rdma");
      o.mode = *mode;
    } else if (name == "--setup-timeout") {
      o.setup_timeout = parse_seconds(name, value());
    } else if (name == "--json") {
      o.json_path = value();
    } else {
      throw UsageError(fmt::format("unknown option '{}'", args[i]));
    }
  }
  if (o.backends.empty()) throw UsageError("no backend to measure");
  if (o.recvs.empty()) throw UsageError("--recv: no receive set-up");
  if (o.counts.empty()) throw UsageError("--connections-list: no count");
  if (!std::is_sorted(o.counts.begin(), o.counts.end()) ||
      std::adjacent_find(o.counts.begin(), o.counts.end()) != o.counts.end()) {
    throw UsageError("--connections-list: counts must increase");
  }
  if (o.counts.back() > 250 * 254) throw UsageError("--connections-list: at most 63500");
  if (o.buf_size == 0 || o.num_buf == 0) throw UsageError("--buf-size and --num-buf must be > 0");
  if (o.batch == 0) throw UsageError("--batch must be > 0");
  if (o.idle_seconds <= 0.0) throw UsageError("--idle-seconds must be > 0");
  if (o.child && (o.backends.size() != 1 || o.recvs.size() != 1)) {
    throw UsageError("--child runs one backend and one receive set-up");
  }
  return o;
}

// ---- process measurements -------------------------------------------------------------

void raise_fd_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      std::fprintf(stderr, "netio3-bench-idle: cannot raise RLIMIT_NOFILE: %s\n",
                   std::strerror(errno));  // NOLINT(concurrency-mt-unsafe)
    }
  }
}

std::uint64_t fd_limit() {
  rlimit limit{};
  return ::getrlimit(RLIMIT_NOFILE, &limit) == 0 ? limit.rlim_cur : 0;
}

struct Memory {
  double rss_kib{};
  double vsz_kib{};
};

Memory memory() {
  std::ifstream statm{"/proc/self/statm"};
  std::size_t size = 0;
  std::size_t resident = 0;
  statm >> size >> resident;
  const double page_kib = static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1024.0;
  return {static_cast<double>(resident) * page_kib, static_cast<double>(size) * page_kib};
}

std::size_t count_entries(const char* dir) {
  std::error_code ec;
  std::size_t n = 0;
  for (std::filesystem::directory_iterator it{dir, ec}, end; !ec && it != end; it.increment(ec)) {
    ++n;
  }
  return n;
}

std::size_t open_fds() {
  return count_entries("/proc/self/fd") - 1;  // the iterator's own descriptor
}

double process_cpu_ms() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  const auto ms = [](const timeval& tv) {
    return static_cast<double>(tv.tv_sec) * 1e3 + static_cast<double>(tv.tv_usec) / 1e3;
  };
  return ms(usage.ru_utime) + ms(usage.ru_stime);
}

double thread_cpu_ms(clockid_t clock) {
  timespec ts{};
  if (::clock_gettime(clock, &ts) != 0) return 0.0;
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

// Context switches of every thread of the process (voluntary + involuntary): a thread that
// sleeps in a system call switches once each time it wakes up and goes back to sleep.
struct ThreadSample {
  std::string name;
  std::uint64_t switches{};
};

std::map<pid_t, ThreadSample> sample_threads() {
  std::map<pid_t, ThreadSample> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it{"/proc/self/task", ec}, end; !ec && it != end;
       it.increment(ec)) {
    const std::string tid_text = it->path().filename().string();
    pid_t tid = 0;
    if (std::from_chars(tid_text.data(), tid_text.data() + tid_text.size(), tid).ec !=
        std::errc{}) {
      continue;
    }
    ThreadSample sample;
    std::ifstream status{it->path() / "status"};
    std::string line;
    while (std::getline(status, line)) {
      if (line.starts_with("Name:")) {
        sample.name = line.substr(line.find_first_not_of(" \t", 5));
      } else if (line.find("ctxt_switches:") != std::string::npos) {
        sample.switches += std::strtoull(line.c_str() + line.find(':') + 1, nullptr, 10);
      }
    }
    std::replace_if(
        sample.name.begin(), sample.name.end(),
        [](char c) { return c == ' ' || c == '=' || c == ';' || c == '"' || c == '\\'; }, '_');
    out.emplace(tid, std::move(sample));
  }
  return out;
}

// ---- the child: one backend, one receive set-up -------------------------------------------

// Key=value lines to the parent (written whole, each below PIPE_BUF).
class Emitter {
 public:
  explicit Emitter(int fd) : m_fd{fd} {}
  void line(const std::string& text) const {
    const std::string out = text + "\n";
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::write(m_fd, out.data() + done, out.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      done += static_cast<std::size_t>(n);
    }
  }

 private:
  int m_fd;
};

// What the backend's callbacks reported.
struct Tally {
  std::mutex mutex;
  std::condition_variable cv;
  std::unordered_set<EndPointAddress> targets;  // addresses the active endpoints connect to
  std::size_t active_established{};
  std::size_t passive_established{};
  std::size_t refusals{};                 // every refusal, also the ones retried
  std::vector<EndPointAddress> to_retry;  // refused, not yet opened again
  std::size_t closed{};
  std::atomic<std::uint64_t> messages{0};
  std::string problem;  // the first close

  [[nodiscard]] std::uint64_t events() const {
    return active_established + passive_established + refusals + closed + messages.load();
  }
};

// ips: one listener, clients connect to 127.0.0.1, 127.0.0.2, ..., 127.0.0.254, 127.0.1.1, ...
// (netio3 names an active endpoint by the address it connects to).
EndPointAddress loopback_address(std::size_t i, std::uint16_t port) {
  return {fmt::format("127.0.{}.{}", i / 254, i % 254 + 1), port};
}

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

Addressing addressing_for(const Options& o, BackendType type) {
  if (o.addressing != Addressing::AUTO) return o.addressing;
  return type == BackendType::UCX ? Addressing::PORTS : Addressing::IPS;
}

int run_child(const Options& o) {
  const BackendType type = o.backends.front();
  const Recv recv = o.recvs.front();
  const Addressing addressing = addressing_for(o, type);
  const Emitter emit{::fcntl(RESULT_FD, F_GETFD) != -1 ? RESULT_FD : STDOUT_FILENO};
  raise_fd_limit();

  Tally tally;
  netio3::NetworkConfig config{.mode = o.mode, .thread_safety = netio3::ThreadSafetyModel::SAFE};
  if (recv == Recv::SHARED) {
    config.shared_receive_buffers = {
        .use_shared_receive_buffers = true, .buf_size = o.buf_size, .num_buf = o.num_buf};
  }
  config.on_connection_established_cb = [&](const EndPointAddress& remote,
                                            netio3::EndpointCapabilities) {
    {
      const std::lock_guard lock{tally.mutex};
      if (tally.targets.contains(remote)) {
        ++tally.active_established;
      } else {
        ++tally.passive_established;
      }
    }
    tally.cv.notify_all();
  };
  // With many connections to one listener, the kernel gives two of them the same source
  // port now and then (it is unique per destination, and the destinations differ): the
  // listener then refuses the second one, whose name (the peer's address) is taken. Such a
  // set-up is tried again; the number of refusals is reported.
  config.on_connection_refused_cb = [&](const EndPointAddress& remote) {
    {
      const std::lock_guard lock{tally.mutex};
      ++tally.refusals;
      tally.to_retry.push_back(remote);
    }
    tally.cv.notify_all();
  };
  config.on_connection_closed_cb = [&](const EndPointAddress& remote,
                                       const std::vector<std::uint64_t>&) {
    {
      const std::lock_guard lock{tally.mutex};
      if (tally.closed++ == 0) tally.problem = fmt::format("connection with {} closed", remote);
    }
    tally.cv.notify_all();
  };
  config.on_data_cb = [&](std::span<const std::uint8_t>) { ++tally.messages; };

  netio3::ConnectionParameters listen_params;
  switch (recv) {
    case Recv::OWN:
      listen_params.recv_params = {.buf_size = o.buf_size, .num_buf = o.num_buf};
      break;
    case Recv::SHARED:
      break;  // the backend-wide pool
    case Recv::LISTENER:
      listen_params.recv_params = {
          .buf_size = o.buf_size, .num_buf = o.num_buf, .use_shared_receive_buffers = true};
      break;
  }
  const netio3::ConnectionParameters client_params{};  // idle: no receive or send buffers

  auto loop = std::make_shared<netio3::EpollEventLoop>();
  std::promise<std::pair<clockid_t, pid_t>> loop_thread_promise;
  auto loop_thread_future = loop_thread_promise.get_future();
  loop->post([&] {
    clockid_t clock{};
    ::pthread_getcpuclockid(::pthread_self(), &clock);
    loop_thread_promise.set_value({clock, ::gettid()});
  });
  std::thread loop_thread{[&loop] { loop->run(); }};
  const auto [loop_clock, loop_tid] = loop_thread_future.get();
  const pid_t main_tid = ::gettid();

  int status = 0;
  std::unique_ptr<netio3::NetworkBackend> backend;
  std::vector<EndPointAddress> targets;  // what the clients connect to, in order
  std::size_t attempts = 0;              // open_active_endpoint calls
  const auto fail = [&](const std::string& why) {
    std::size_t reached = 0;
    std::size_t refusals = 0;
    {
      const std::lock_guard lock{tally.mutex};
      reached = std::min(tally.active_established, tally.passive_established);
      refusals = tally.refusals;
    }
    emit.line(fmt::format("ERROR reached={} attempts={} refusals={} fds={} fd_limit={} reason={}",
                          reached, attempts, refusals, open_fds(), fd_limit(), one_line(why)));
    status = EXIT_SETUP_FAILED;
  };
  try {
    backend = netio3::Netio3Backend::create(type, std::move(config), loop);
    // ips: one listener, opened now. ports: a listener per connection, opened before the
    // connections of each count; what opening them added is reported apart (listener_*),
    // so that the growth per connection can leave it out. Clients connect to
    // 127.0.0.1:<its port>.
    std::size_t listeners = 0;
    const auto open_listeners = [&](std::size_t wanted) {
      while (listeners < wanted) {
        const auto listen = backend->open_listen_endpoint({"0.0.0.0", 0}, listen_params);
        ++listeners;
        const std::size_t first = targets.size();
        if (addressing == Addressing::PORTS) {
          targets.push_back({"127.0.0.1", listen.port});
        } else {
          for (std::size_t c = 0; c < o.counts.back(); ++c) {
            targets.push_back(loopback_address(c, listen.port));
          }
        }
        const std::lock_guard lock{tally.mutex};
        tally.targets.insert(targets.begin() + static_cast<std::ptrdiff_t>(first), targets.end());
      }
    };
    if (addressing == Addressing::IPS) open_listeners(1);
    const auto base = memory();
    emit.line(fmt::format("BASE rss_kib={:.0f} vsz_kib={:.0f} fds={} threads={} listeners={}",
                          base.rss_kib, base.vsz_kib, open_fds(), count_entries("/proc/self/task"),
                          listeners));
    std::size_t progress = 0;  // established connections last reported
    std::size_t next = 0;      // the next target to open
    std::unordered_map<EndPointAddress, std::size_t> tries;
    for (const std::size_t target : o.counts) {
      const auto before_listeners = memory();
      const std::size_t fds_before_listeners = open_fds();
      if (addressing == Addressing::PORTS) open_listeners(target);
      const auto after_listeners = memory();
      const std::size_t fds_after_listeners = open_fds();
      const auto started = Clock::now();
      const auto deadline = started + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>{o.setup_timeout});
      std::unique_lock lock{tally.mutex};
      const auto in_flight = [&] { return attempts - tally.active_established - tally.refusals; };
      std::string error;
      while (error.empty()) {
        if (!tally.cv.wait_until(lock, deadline, [&] {
              return tally.closed > 0 || !tally.to_retry.empty() ||
                     (next < target && in_flight() < o.batch) ||
                     (next == target && in_flight() == 0);
            })) {
          error = fmt::format("{} set-ups still pending after {} s", in_flight(), o.setup_timeout);
          break;
        }
        if (tally.closed > 0) {
          error = tally.problem;
          break;
        }
        // For a run that dies on the way (a transport aborting the process).
        if (const auto reached = std::min(tally.active_established, tally.passive_established);
            reached >= progress + 10) {
          progress = reached;
          emit.line(fmt::format("PROGRESS reached={} attempts={} refusals={}", reached, attempts,
                                tally.refusals));
        }
        EndPointAddress address;
        if (!tally.to_retry.empty()) {
          address = tally.to_retry.back();
          tally.to_retry.pop_back();
          if (tries[address] > o.retries) {
            error = fmt::format("connection to {} refused {} times", address, tries[address]);
            break;
          }
        } else if (next < target && in_flight() < o.batch) {
          address = targets[next++];
        } else {
          break;  // every client of this count established
        }
        ++tries[address];
        ++attempts;
        lock.unlock();
        try {
          backend->open_active_endpoint(address, client_params);
        } catch (const std::exception& e) {
          error = fmt::format("open_active_endpoint({}): {}", address, e.what());
        }
        lock.lock();
      }
      if (error.empty() && !tally.cv.wait_until(lock, deadline, [&] {
            return tally.closed > 0 || tally.passive_established >= target;
          })) {
        error = fmt::format("after {} s: {} of {} active and {} accepted endpoints established",
                            o.setup_timeout, tally.active_established, target,
                            tally.passive_established);
      }
      if (error.empty() && tally.closed > 0) error = tally.problem;
      if (error.empty() &&
          (tally.active_established != target || tally.passive_established != target)) {
        error = fmt::format("{} active and {} accepted endpoints established, expected {}",
                            tally.active_established, tally.passive_established, target);
      }
      const std::size_t refusals = tally.refusals;
      lock.unlock();
      if (!error.empty()) {
        fail(fmt::format("{} connections: {}", target, error));
        break;
      }
      const double setup_s = std::chrono::duration<double>(Clock::now() - started).count();

      // Timers armed for the set-up (the 100 ms connect-deadline check) stop at their next
      // expiry once nothing is pending; the window starts after that.
      std::this_thread::sleep_for(std::chrono::duration<double>{o.settle_seconds});
      const auto threads0 = sample_threads();
      const std::uint64_t events0 = [&] {
        const std::lock_guard events_lock{tally.mutex};
        return tally.events();
      }();
      // getrusage counts this thread's CPU time up to its last switch: sleeping a moment
      // first keeps the sampling above out of the window.
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
      const double cpu0 = process_cpu_ms();
      const double main0 = thread_cpu_ms(CLOCK_THREAD_CPUTIME_ID);
      const double loop_cpu0 = thread_cpu_ms(loop_clock);
      const std::uint64_t wakeups0 = loop->wakeups();
      const auto t0 = Clock::now();
      std::this_thread::sleep_for(std::chrono::duration<double>{o.idle_seconds});
      const double window = std::chrono::duration<double>(Clock::now() - t0).count();
      const std::uint64_t wakeups1 = loop->wakeups();
      const double loop_cpu1 = thread_cpu_ms(loop_clock);
      const double main1 = thread_cpu_ms(CLOCK_THREAD_CPUTIME_ID);
      const double cpu1 = process_cpu_ms();
      const auto threads1 = sample_threads();
      const std::uint64_t events1 = [&] {
        const std::lock_guard events_lock{tally.mutex};
        return tally.events();
      }();
      const auto mem = memory();
      const std::size_t fds = open_fds();

      // Switches of the threads that are neither the loop nor this (sleeping) one.
      std::uint64_t other_switches = 0;
      std::string busy;
      for (const auto& [tid, after] : threads1) {
        if (tid == loop_tid || tid == main_tid) continue;
        const auto before = threads0.find(tid);
        const std::uint64_t n =
            after.switches - (before == threads0.end() ? 0 : before->second.switches);
        other_switches += n;
        if (n > 0) busy += fmt::format("{}{}/{}:{}", busy.empty() ? "" : ";", after.name, tid, n);
      }
      emit.line(fmt::format(
          "STEP connections={} setup_s={:.3f} refusals={} window_s={:.3f} cpu_ms={:.3f} "
          "main_cpu_ms={:.3f} loop_cpu_ms={:.3f} wakeups={} other_switches={} events={} "
          "rss_kib={:.0f} vsz_kib={:.0f} fds={} threads={} busy_threads={} listeners={} "
          "listener_rss_kib={:.0f} listener_vsz_kib={:.0f} listener_fds={}",
          target, setup_s, refusals, window, cpu1 - cpu0, main1 - main0, loop_cpu1 - loop_cpu0,
          wakeups1 - wakeups0, other_switches, events1 - events0, mem.rss_kib, mem.vsz_kib, fds,
          threads1.size(), busy.empty() ? "-" : busy, listeners,
          after_listeners.rss_kib - before_listeners.rss_kib,
          after_listeners.vsz_kib - before_listeners.vsz_kib,
          static_cast<std::int64_t>(fds_after_listeners) -
              static_cast<std::int64_t>(fds_before_listeners)));
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
  const auto teardown_started = Clock::now();
  backend.reset();
  loop->stop();
  loop_thread.join();
  emit.line(fmt::format("DONE teardown_s={:.3f}",
                        std::chrono::duration<double>(Clock::now() - teardown_started).count()));
  return status;
}

// ---- the parent: one child per backend and receive set-up --------------------------------

using Fields = std::map<std::string, std::string>;

Fields parse_fields(std::string_view line) {
  Fields out;
  std::istringstream in{std::string{line}};
  std::string word;
  while (in >> word) {
    const auto eq = word.find('=');
    if (eq == std::string::npos) continue;
    std::string key = word.substr(0, eq);
    std::string value = word.substr(eq + 1);
    if (key == "reason") {  // the rest of the line
      std::string rest;
      std::getline(in, rest);
      value += rest;
    }
    out.emplace(std::move(key), std::move(value));
  }
  return out;
}

double number(const Fields& fields, const std::string& key) {
  const auto it = fields.find(key);
  return it == fields.end() ? 0.0 : std::strtod(it->second.c_str(), nullptr);
}

std::string text(const Fields& fields, const std::string& key) {
  const auto it = fields.find(key);
  return it == fields.end() ? std::string{} : it->second;
}

struct Run {
  BackendType backend{};
  Recv recv{};
  Addressing addressing{};
  Fields base{};
  std::vector<Fields> steps{};
  std::optional<Fields> error{};
  std::optional<Fields> progress{};
  std::optional<Fields> done{};
  std::string exit{};  // how the child ended, when not with status 0
};

// Spawns this program with --child for one backend and receive set-up; its result lines
// come through a pipe on fd 3, its stdout and stderr (transport logs) pass through.
Run run_one(const Options& o, BackendType backend, Recv recv) {
  Run run{.backend = backend, .recv = recv, .addressing = addressing_for(o, backend)};
  std::string counts;
  for (const auto n : o.counts) counts += fmt::format("{}{}", counts.empty() ? "" : ",", n);
  const std::vector<std::string> args{"netio3-bench-idle",
                                      "--child",
                                      "--backend",
                                      std::string{netio3::to_string(backend)},
                                      "--recv",
                                      std::string{to_string(recv)},
                                      "--connections-list",
                                      counts,
                                      "--idle-seconds",
                                      fmt::format("{}", o.idle_seconds),
                                      "--settle-seconds",
                                      fmt::format("{}", o.settle_seconds),
                                      "--buf-size",
                                      fmt::format("{}", o.buf_size),
                                      "--num-buf",
                                      fmt::format("{}", o.num_buf),
                                      "--batch",
                                      fmt::format("{}", o.batch),
                                      "--retries",
                                      fmt::format("{}", o.retries),
                                      "--addressing",
                                      std::string{to_string(o.addressing)},
                                      "--mode",
                                      std::string{netio3::to_string(o.mode)},
                                      "--setup-timeout",
                                      fmt::format("{}", o.setup_timeout)};
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));  // NOLINT
  argv.push_back(nullptr);

  int pipe_fds[2] = {-1, -1};
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    run.exit = fmt::format("pipe2: {}", std::strerror(errno));  // NOLINT(concurrency-mt-unsafe)
    return run;
  }
  int write_end = pipe_fds[1];
  if (write_end == RESULT_FD) {  // dup2 onto itself would keep FD_CLOEXEC
    write_end = ::fcntl(pipe_fds[1], F_DUPFD_CLOEXEC, RESULT_FD + 1);
    ::close(pipe_fds[1]);
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, write_end, RESULT_FD);
  pid_t pid = -1;
  const int spawned =
      ::posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(write_end);
  if (spawned != 0) {
    ::close(pipe_fds[0]);
    run.exit = fmt::format("posix_spawn: {}", std::strerror(spawned));  // NOLINT
    return run;
  }

  // Every count may take the set-up timeout plus its windows; the teardown (UCX flushes for
  // up to its 2 s close timeout) gets a minute.
  const double budget = static_cast<double>(o.counts.size()) *
                            (o.setup_timeout + o.settle_seconds + o.idle_seconds + 5.0) +
                        60.0;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>{budget});
  std::string buffer;
  bool killed = false;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      ::kill(pid, SIGKILL);
      killed = true;
      break;
    }
    pollfd pfd{.fd = pipe_fds[0], .events = POLLIN, .revents = 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<std::int64_t>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) continue;
    char chunk[4096];
    const ssize_t n = ::read(pipe_fds[0], chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: the child is gone
    buffer.append(chunk, static_cast<std::size_t>(n));
  }
  ::close(pipe_fds[0]);
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }

  std::istringstream lines{buffer};
  std::string line;
  while (std::getline(lines, line)) {
    const auto space = line.find(' ');
    const std::string kind = line.substr(0, space);
    const Fields fields =
        parse_fields(space == std::string::npos ? std::string_view{} : line.substr(space + 1));
    if (kind == "BASE") {
      run.base = fields;
    } else if (kind == "STEP") {
      run.steps.push_back(fields);
    } else if (kind == "ERROR") {
      run.error = fields;
    } else if (kind == "PROGRESS") {
      run.progress = fields;
    } else if (kind == "DONE") {
      run.done = fields;
    }
  }
  if (killed) {
    run.exit = fmt::format("killed after {:.0f} s", budget);
  } else if (WIFSIGNALED(wstatus)) {
    run.exit = fmt::format("died of signal {} ({})", WTERMSIG(wstatus),
                           ::strsignal(WTERMSIG(wstatus)));  // NOLINT(concurrency-mt-unsafe)
  } else if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) != 0) {
    run.exit = fmt::format("exit status {}", WEXITSTATUS(wstatus));
  }
  if (!run.exit.empty() && !run.done && !run.error) {
    // UCX's own SIGSEGV/SIGABRT handler prints a backtrace and exits with status 1.
    run.exit += " without a result: it crashed (see the backtrace above)";
  }
  return run;
}

// The most connections that were established at once (also in a run that died).
double connections_reached(const Run& run) {
  double reached = run.steps.empty() ? 0.0 : number(run.steps.back(), "connections");
  if (run.progress) reached = std::max(reached, number(*run.progress, "reached"));
  if (run.error) reached = std::max(reached, number(*run.error, "reached"));
  return reached;
}

bool complete(const Run& run, const Options& o) {
  return run.exit.empty() && !run.error && run.steps.size() == o.counts.size();
}

// The growth per connection between the first and the last count reached (or from the
// state before any connection, when only one count was reached).
struct PerConnection {
  double from{};
  double to{};
  double rss_kib{};
  double vsz_kib{};
  double fds{};
};

std::optional<PerConnection> per_connection(const Run& run) {
  if (run.steps.empty()) return std::nullopt;
  const Fields& last = run.steps.back();
  const bool from_base = run.steps.size() == 1;
  const Fields& first = from_base ? run.base : run.steps.front();
  const double from = from_base ? 0.0 : number(first, "connections");
  const double to = number(last, "connections");
  if (to <= from) return std::nullopt;
  const double n = to - from;
  // Less what opening listeners added in between (one listener per connection: ports).
  const auto growth = [&](const std::string& key) {
    double listeners = 0.0;
    for (std::size_t i = from_base ? 0 : 1; i < run.steps.size(); ++i) {
      listeners += number(run.steps[i], "listener_" + key);
    }
    return (number(last, key) - number(first, key) - listeners) / n;
  };
  return PerConnection{from, to, growth("rss_kib"), growth("vsz_kib"), growth("fds")};
}

double per_second(const Fields& step, const std::string& key) {
  const double window = number(step, "window_s");
  return window > 0.0 ? number(step, key) / window : 0.0;
}

// The process's CPU time without the measuring (sleeping) main thread's, about 0.2 ms
// for going to sleep and waking up once, here.
double cpu_per_second(const Fields& step) {
  const double window = number(step, "window_s");
  return window > 0.0 ? (number(step, "cpu_ms") - number(step, "main_cpu_ms")) / window : 0.0;
}

// The transports' settings from the environment (UCX_*, FI_*, NETIO3_*), as a JSON object.
std::string transport_environment() {
  std::string out;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry{*e};
    if (!entry.starts_with("UCX_") && !entry.starts_with("FI_") && !entry.starts_with("NETIO3_")) {
      continue;
    }
    const auto eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    out += fmt::format("{}{}:{}", out.empty() ? "" : ",", json_string(entry.substr(0, eq)),
                       json_string(entry.substr(eq + 1)));
  }
  return "{" + out + "}";
}

std::string json_line(const Run& run, const Options& o) {
  std::string steps;
  for (const auto& s : run.steps) {
    steps += fmt::format(
        "{}{{\"connections\":{},\"setup_s\":{},\"refusals\":{},\"window_s\":{},\"cpu_ms\":{},"
        "\"main_cpu_ms\":{},\"loop_cpu_ms\":{},\"cpu_ms_per_s\":{:.4f},"
        "\"cpu_ms_per_s_without_main\":{:.4f},\"loop_cpu_ms_per_s\":{:.4f},\"wakeups\":{},"
        "\"wakeups_per_s\":{:.3f},\"other_thread_switches_per_s\":{:.3f},\"events\":{},"
        "\"rss_kib\":{},\"vsz_kib\":{},\"fds\":{},\"threads\":{},\"busy_threads\":{},"
        "\"listeners\":{},\"listener_rss_kib\":{},\"listener_vsz_kib\":{},\"listener_fds\":{}}}",
        steps.empty() ? "" : ",", text(s, "connections"), text(s, "setup_s"), text(s, "refusals"),
        text(s, "window_s"), text(s, "cpu_ms"), text(s, "main_cpu_ms"), text(s, "loop_cpu_ms"),
        per_second(s, "cpu_ms"), cpu_per_second(s), per_second(s, "loop_cpu_ms"),
        text(s, "wakeups"), per_second(s, "wakeups"), per_second(s, "other_switches"),
        text(s, "events"), text(s, "rss_kib"), text(s, "vsz_kib"), text(s, "fds"),
        text(s, "threads"), json_string(text(s, "busy_threads")), text(s, "listeners"),
        text(s, "listener_rss_kib"), text(s, "listener_vsz_kib"), text(s, "listener_fds"));
  }
  std::string per;
  if (const auto p = per_connection(run)) {
    per = fmt::format(
        "{{\"from\":{},\"to\":{},\"rss_kib\":{:.3f},\"vsz_kib\":{:.3f},\"fds\":{:.3f}}}", p->from,
        p->to, p->rss_kib, p->vsz_kib, p->fds);
  } else {
    per = "null";
  }
  std::string error;
  if (run.error) error = text(*run.error, "reason");
  if (!run.exit.empty()) error += fmt::format("{}child {}", error.empty() ? "" : "; ", run.exit);
  const double reached = connections_reached(run);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char when[32] = {};
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return fmt::format(
      "{{\"bench\":\"idle\",\"time\":\"{}\",\"host\":{},\"backend\":\"{}\",\"recv\":\"{}\","
      "\"addressing\":\"{}\",\"listeners\":{},"
      "\"buf_size\":{},\"num_buf\":{},\"idle_seconds\":{},\"settle_seconds\":{},"
      "\"ok\":{},\"reached\":{},\"error\":{},\"base\":{{\"rss_kib\":{},\"vsz_kib\":{},"
      "\"fds\":{},\"threads\":{}}},\"steps\":[{}],\"per_connection\":{},\"teardown_s\":{},"
      "\"environment\":{}}}",
      when, json_string(host), netio3::to_string(run.backend), to_string(run.recv),
      to_string(run.addressing),
      run.steps.empty() ? number(run.base, "listeners") : number(run.steps.back(), "listeners"),
      o.buf_size, o.num_buf, o.idle_seconds, o.settle_seconds, complete(run, o) ? "true" : "false",
      reached, json_string(error), number(run.base, "rss_kib"), number(run.base, "vsz_kib"),
      number(run.base, "fds"), number(run.base, "threads"), steps, per,
      run.done ? text(*run.done, "teardown_s") : "null", transport_environment());
}

void print_rows(const Run& run) {
  const std::string name{netio3::to_string(run.backend)};
  const std::string recv{to_string(run.recv)};
  const std::string addressing{to_string(run.addressing)};
  for (const auto& s : run.steps) {
    const std::string events = number(s, "events") > 0
                                   ? fmt::format("  ({} callbacks while idle)", text(s, "events"))
                                   : std::string{};
    std::printf("%-9s %-8s %-5s %6s %7.2f %7s %9.3f %9.3f %9.2f %9.2f %8.1f %8.1f %6s%s\n",
                name.c_str(), recv.c_str(), addressing.c_str(), text(s, "connections").c_str(),
                number(s, "setup_s"), text(s, "refusals").c_str(), cpu_per_second(s),
                per_second(s, "loop_cpu_ms"), per_second(s, "wakeups"),
                per_second(s, "other_switches"), number(s, "rss_kib") / 1024.0,
                number(s, "vsz_kib") / 1024.0, text(s, "fds").c_str(), events.c_str());
  }
  if (run.error) {
    std::printf(
        "%-9s %-8s %-5s FAILED: %s connections established (%s set-ups started, %s refused, %s "
        "fds open, limit %s): %s\n",
        name.c_str(), recv.c_str(), addressing.c_str(), text(*run.error, "reached").c_str(),
        text(*run.error, "attempts").c_str(), text(*run.error, "refusals").c_str(),
        text(*run.error, "fds").c_str(), text(*run.error, "fd_limit").c_str(),
        text(*run.error, "reason").c_str());
  }
  if (!run.exit.empty()) {
    std::printf("%-9s %-8s %-5s child %s (%.0f connections had been established)\n", name.c_str(),
                recv.c_str(), addressing.c_str(), run.exit.c_str(), connections_reached(run));
  }
  std::fflush(stdout);
}

int run_parent(const Options& o) {
  raise_fd_limit();
  std::printf(
      "netio3-bench-idle: idle windows of %s s, receive pools of %zu x %zu B, RLIMIT_NOFILE "
      "%llu\n",
      fmt::format("{}", o.idle_seconds).c_str(), o.num_buf, o.buf_size,
      static_cast<unsigned long long>(fd_limit()));
  std::printf("%-9s %-8s %-5s %6s %7s %7s %9s %9s %9s %9s %8s %8s %6s\n", "backend", "recv", "addr",
              "conns", "setup s", "refused", "CPU ms/s", "loop ms/s", "wakeups/s", "other/s",
              "RSS MiB", "VSZ MiB", "fds");
  std::fflush(stdout);
  std::vector<Run> runs;
  bool all_ok = true;
  for (const BackendType backend : o.backends) {
    for (const Recv recv : o.recvs) {
      if (recv == Recv::LISTENER && addressing_for(o, backend) == Addressing::PORTS) {
        std::printf(
            "%-9s %-8s %-5s skipped: one listener per connection gives every connection "
            "a pool of its own\n",
            std::string{netio3::to_string(backend)}.c_str(), std::string{to_string(recv)}.c_str(),
            "ports");
        continue;
      }
      runs.push_back(run_one(o, backend, recv));
      const Run& run = runs.back();
      print_rows(run);
      all_ok = all_ok && complete(run, o);
      if (!o.json_path.empty()) {
        std::ofstream json{o.json_path, std::ios::app};
        json << json_line(run, o) << '\n';
        if (!json) {
          std::fprintf(stderr, "netio3-bench-idle: cannot append to %s\n", o.json_path.c_str());
          all_ok = false;
        }
      }
    }
  }
  std::printf(
      "\nper connection (one active + one accepted endpoint, both in the process), between the "
      "first and the last count reached:\n");
  std::printf("%-9s %-8s %-5s %13s %10s %10s %7s\n", "backend", "recv", "addr", "conns", "RSS KiB",
              "VSZ KiB", "fds");
  for (const Run& run : runs) {
    const auto p = per_connection(run);
    if (!p) continue;
    std::printf(
        "%-9s %-8s %-5s %13s %10.2f %10.2f %7.2f\n",
        std::string{netio3::to_string(run.backend)}.c_str(),
        std::string{to_string(run.recv)}.c_str(), std::string{to_string(run.addressing)}.c_str(),
        fmt::format("{:.0f}->{:.0f}", p->from, p->to).c_str(), p->rss_kib, p->vsz_kib, p->fds);
  }
  std::printf(
      "\nCPU ms/s: process CPU time (getrusage user+sys) per second of idle, less the measuring "
      "main thread's (CLOCK_THREAD_CPUTIME_ID; the JSON has both); loop ms/s: the "
      "event-loop thread's alone; wakeups/s: BaseEventLoop::wakeups(); other/s: context "
      "switches of the other threads (the transport's own, e.g. UCX's async thread; not the "
      "sleeping main thread); refused: set-ups refused and tried again.\n");
  return all_ok ? 0 : EXIT_SETUP_FAILED;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_options(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "netio3-bench-idle: %s\n%s", e.what(), USAGE);
    return EXIT_USAGE;
  }
  ::signal(SIGPIPE, SIG_IGN);  // NOLINT(cert-err33-c)
  return options.child ? run_child(options) : run_parent(options);
}
