// netio3-perf: throughput and latency of netio3's backends, between two processes or
// inside one (--loopback). See docs/benchmarks.md.
//
//   netio3-perf --server [--backend B] [--mode tcp|rdma] [--bind IP] [--port P]
//               [--max-size BYTES]
//   netio3-perf --client IP:PORT [run options]
//   netio3-perf [--loopback] [run options]
//   netio3-perf --list-backends
//
// Run options: --backend asyncmsg|libfabric|ucx  --mode tcp|rdma
//   --send buffered|zero-copy|copy  --test throughput|latency  --size N[,N...] (k/m: KiB/MiB)
//   --duration SECONDS  --connections N  --threads N (0: send from the loop thread)
//   --window N  --verify light|full  --warmup N  --busy-poll US  --json FILE  --quiet  --stats
//   --on-ready  --same-buffer  --acknowledged  --session
//
// Exit status: 0 when every message arrived intact, 1 when one did not, 2 for bad options,
// 3 when a run could not be done (no connection, a stall, a failed send).

#include <charconv>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <signal.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "json_text.hpp"
#include "perf_client.hpp"
#include "perf_server.hpp"

using namespace netio3;
using namespace netio3::perf;
using netio3::tools::json_string;

namespace {

constexpr int EXIT_LOST = 1;
constexpr int EXIT_USAGE = 2;
constexpr int EXIT_ERROR = 3;

const char* const USAGE = R"(usage:
  netio3-perf --server [--backend B] [--mode tcp|rdma] [--bind IP] [--port P] [--max-size BYTES]
              [--busy-poll US] [--partition-key KEY]
  netio3-perf --client IP:PORT [run options]
  netio3-perf [--loopback] [run options]          (server and client in this process)
  netio3-perf --list-backends
run options:
  --backend asyncmsg|libfabric|ucx   (default asyncmsg)
  --mode tcp|rdma                    (default tcp)
  --send buffered|zero-copy|copy     (default buffered)
  --test throughput|latency          (default throughput)
  --size N[,N...]                    bytes per message, k/m suffix = KiB/MiB (default 4k)
  --duration SECONDS                 per size (default 5)
  --connections N                    (default 1)
  --threads N                        sender threads; 0 sends from the event-loop thread
                                     with an UNSAFE backend (default 0)
  --window N                         buffers or zero-copy slots per connection (default auto)
  --verify light|full                content check of every message (default light: first
                                     and last payload byte; full: every byte)
  --warmup N                         latency: round trips left out (default 1000)
  --busy-poll US                     event loops poll this long after activity before
                                     sleeping (EpollEventLoop::Options; default 0, or
                                     NETIO3_BUSY_POLL_US); also for --server
  --partition-key KEY                admission (docs/admission.md): both ends prove KEY (at
                                     least 16 bytes) when connecting; also for --server.
                                     Each run reports its mean connection set-up time
  --json FILE                        append one JSON record per run (JSON Lines)
  --quiet                            no progress line
  --stats                            print the client backend's statistics after each run
                                     (NetworkBackend::backend_statistics)
  --on-ready                         throughput with --threads 0, buffered or copy: send
                                     only from on_ready_to_send_cb (after one fill per
                                     connection), never retry from the loop
  --same-buffer                      zero-copy: every message's payload from one buffer,
                                     written once, up to --window in flight (what iperf3 and
                                     ucx_perftest do); sizes and order checked, not content
  --acknowledged                     the client's sends are acknowledged: each completes once
                                     the server's application was handed it
  --session                          asyncmsg: the client's connections have a session
                                     (acknowledged, and resumed after a cut: docs/sessions.md)
exit status: 0 every message arrived intact, 1 something was lost or corrupted,
             2 bad options, 3 a run could not be done
)";

struct Args {
  std::map<std::string, std::string> values;
  std::vector<std::string> flags;
  [[nodiscard]] bool flag(const std::string& name) const {
    return std::find(flags.begin(), flags.end(), name) != flags.end();
  }
  [[nodiscard]] std::string get(const std::string& name, const std::string& fallback) const {
    const auto it = values.find(name);
    return it == values.end() ? fallback : it->second;
  }
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

Args parse_args(int argc, char** argv) {
  static const std::vector<std::string> FLAGS{
      "server", "loopback", "quiet",       "stats",        "list-backends",
      "help",   "on-ready", "same-buffer", "acknowledged", "session"};
  static const std::vector<std::string> VALUES{
      "client",   "backend",     "mode",    "send",     "test",      "size",
      "duration", "connections", "threads", "window",   "verify",    "warmup",
      "json",     "bind",        "port",    "max-size", "busy-poll", "partition-key"};
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h") arg = "--help";
    if (!arg.starts_with("--")) throw UsageError{fmt::format("unexpected argument '{}'", arg)};
    arg.erase(0, 2);
    std::string value;
    bool has_value = false;
    if (const auto eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg.erase(eq);
      has_value = true;
    }
    if (std::find(FLAGS.begin(), FLAGS.end(), arg) != FLAGS.end()) {
      if (has_value) throw UsageError{fmt::format("--{} takes no value", arg)};
      args.flags.push_back(arg);
    } else if (std::find(VALUES.begin(), VALUES.end(), arg) != VALUES.end()) {
      if (!has_value) {
        if (i + 1 >= argc) throw UsageError{fmt::format("--{} needs a value", arg)};
        value = argv[++i];
      }
      args.values[arg] = value;
    } else {
      throw UsageError{fmt::format("unknown option --{}", arg)};
    }
  }
  return args;
}

std::uint64_t parse_number(const std::string& name, std::string_view text) {
  std::uint64_t value = 0;
  std::uint64_t scale = 1;
  if (!text.empty()) {
    const char last = text.back();
    if (last == 'k' || last == 'K') scale = 1024;
    if (last == 'm' || last == 'M') scale = std::uint64_t{1} << 20U;
    if (last == 'g' || last == 'G') scale = std::uint64_t{1} << 30U;
    if (scale != 1) text.remove_suffix(1);
  }
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size() || text.empty()) {
    throw UsageError{fmt::format("--{}: '{}' is not a number", name, text)};
  }
  return value * scale;
}

std::vector<std::size_t> parse_sizes(const std::string& text) {
  std::vector<std::size_t> sizes;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const auto comma = text.find(',', begin);
    const auto item =
        text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    const std::size_t size = parse_number("size", item);
    if (size < HEADER_SIZE) {
      throw UsageError{
          fmt::format("--size: {} B is below netio3-perf's {}-byte header", size, HEADER_SIZE)};
    }
    if (size > std::numeric_limits<std::uint32_t>::max()) {
      throw UsageError{fmt::format("--size: {} B is too large", size)};
    }
    sizes.push_back(size);
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return sizes;
}

EndPointAddress parse_address(const std::string& text) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    throw UsageError{fmt::format("--client: '{}' is not IP:PORT", text)};
  }
  const auto port = parse_number("client", std::string_view{text}.substr(colon + 1));
  if (port == 0 || port > 65535) throw UsageError{fmt::format("--client: bad port in '{}'", text)};
  return EndPointAddress{text.substr(0, colon), static_cast<std::uint16_t>(port)};
}

std::string json_number(std::optional<double> value) {
  return value ? fmt::format("{:.6g}", *value) : std::string{"null"};
}

struct Common {
  BackendType backend{BackendType::ASYNCMSG};
  NetworkMode mode{NetworkMode::TCP};
};

Common parse_common(const Args& args) {
  Common c;
  const auto backend = parse_backend_type(args.get("backend", "asyncmsg"));
  if (!backend) throw UsageError{"--backend: asyncmsg, libfabric or ucx"};
  if (!Netio3Backend::is_available(*backend)) {
    throw UsageError{fmt::format("--backend {}: not compiled into this build", *backend)};
  }
  const auto mode = parse_network_mode(args.get("mode", "tcp"));
  if (!mode) throw UsageError{"--mode: tcp or rdma"};
  c.backend = *backend;
  c.mode = *mode;
  return c;
}

ServerOptions server_options(const Args& args, const Common& common) {
  ServerOptions o;
  o.backend = common.backend;
  o.mode = common.mode;
  o.bind = args.get("bind", "127.0.0.1");
  const auto port = parse_number("port", args.get("port", "0"));
  if (port > 65535) throw UsageError{"--port: at most 65535"};
  o.port = static_cast<std::uint16_t>(port);
  o.max_size = parse_number("max-size", args.get("max-size", std::to_string(o.max_size)));
  if (o.max_size < HEADER_SIZE) throw UsageError{"--max-size: below the header size"};
  o.quiet = args.flag("quiet");
  o.partition_key = args.get("partition-key", "");
  return o;
}

std::optional<std::chrono::microseconds> busy_poll(const Args& args) {
  if (!args.values.contains("busy-poll")) return std::nullopt;
  const auto us = parse_number("busy-poll", args.get("busy-poll", "0"));
  if (us > 1'000'000) throw UsageError{"--busy-poll: at most 1000000 microseconds"};
  return std::chrono::microseconds{us};
}

int run_server(const Args& args) {
  const auto common = parse_common(args);
  const auto options = server_options(args, common);
  // SIGINT/SIGTERM end the server: blocked here (every thread inherits the mask) and taken
  // with sigwait below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  auto loop = make_loop(busy_poll(args));
  auto server = std::make_unique<PerfServer>(options, loop);
  std::jthread thread{[loop] { loop->run(); }};
  std::cout << fmt::format("listening on {}", server->address()) << std::endl;
  int signal = 0;
  sigwait(&signals, &signal);
  // The loop first: once it has stopped no callback runs, and the server (the backend's
  // facade shuts it down inline then) can go without racing one that is under way.
  loop->stop();
  thread.join();
  server.reset();
  return 0;
}

int run_clients(const Args& args, bool loopback) {
  const auto common = parse_common(args);
  ClientOptions base;
  base.backend = common.backend;
  base.mode = common.mode;
  const auto send = parse_send_kind(args.get("send", "buffered"));
  if (!send) throw UsageError{"--send: buffered, zero-copy or copy"};
  base.send = *send;
  const std::string test = args.get("test", "throughput");
  if (test == "throughput") {
    base.test = Test::THROUGHPUT;
  } else if (test == "latency") {
    base.test = Test::LATENCY;
  } else {
    throw UsageError{"--test: throughput or latency"};
  }
  const std::string verify = args.get("verify", "light");
  if (verify != "light" && verify != "full") throw UsageError{"--verify: light or full"};
  base.verify = verify == "full" ? Verify::FULL : Verify::LIGHT;
  base.same_buffer = args.flag("same-buffer");
  if (base.same_buffer) {
    if (base.send != SendKind::ZERO_COPY) throw UsageError{"--same-buffer: zero-copy sends"};
    if (args.get("verify", "") != "")
      throw UsageError{"--same-buffer: no --verify (every payload is the same)"};
    base.verify = Verify::SIZE;
  }
  double duration = 0;
  try {
    duration = std::stod(args.get("duration", "5"));
  } catch (const std::exception&) {
    throw UsageError{"--duration: seconds"};
  }
  if (!(duration > 0 && duration < 1e6)) throw UsageError{"--duration: seconds, above 0"};
  base.duration = std::chrono::duration<double>{duration};
  base.connections = parse_number("connections", args.get("connections", "1"));
  if (base.connections < 1 || base.connections > MAX_CONNECTIONS) {
    throw UsageError{fmt::format("--connections: 1 to {}", MAX_CONNECTIONS)};
  }
  base.threads = parse_number("threads", args.get("threads", "0"));
  if (base.threads > 256) throw UsageError{"--threads: at most 256"};
  base.window = parse_number("window", args.get("window", "0"));
  if (base.window > 65536) throw UsageError{"--window: at most 65536"};
  base.warmup = parse_number("warmup", args.get("warmup", "1000"));
  base.progress = !args.flag("quiet") && ::isatty(STDERR_FILENO) == 1;
  base.busy_poll = busy_poll(args);
  base.stats = args.flag("stats");
  base.partition_key = args.get("partition-key", "");
  base.on_ready = args.flag("on-ready");
  base.acknowledged = args.flag("acknowledged");
  base.session = args.flag("session");
  if (base.on_ready && (base.threads > 0 || base.test != Test::THROUGHPUT)) {
    throw UsageError{"--on-ready: throughput with --threads 0 only"};
  }
  if (base.on_ready && base.send == SendKind::ZERO_COPY) {
    // Its slots are netio3-perf's own window: a full window is no refusal of the backend's.
    throw UsageError{"--on-ready: buffered or copy sends"};
  }
  const auto sizes = parse_sizes(args.get("size", "4k"));
  const std::string json_path = args.get("json", "");

  // The server: another process (--client) or this one (--loopback).
  // Declared in this order so that the server goes first, then its loop stops, then the
  // loop thread is joined: also when a run throws.
  std::shared_ptr<EpollEventLoop> server_loop;
  std::jthread server_thread;
  struct StopLoop {
    std::shared_ptr<EpollEventLoop>& loop;
    ~StopLoop() {
      if (loop) loop->stop();
    }
  } stop_server_loop{server_loop};
  std::unique_ptr<PerfServer> server;
  EndPointAddress target;
  if (loopback) {
    auto options = server_options(args, common);
    options.quiet = true;
    // The server's buffers fit the largest message of the run, unless --max-size says more:
    // receive buffers of 1 MiB for a 4 KiB run made 128 connections touch 8 GiB (64 buffers
    // each), and the kernel's zeroing of those pages, not netio3, set the rate.
    if (args.get("max-size", "").empty()) options.max_size = 0;
    for (const auto size : sizes) options.max_size = std::max(options.max_size, size);
    server_loop = make_loop(base.busy_poll);
    server = std::make_unique<PerfServer>(options, server_loop);
    server_thread = std::jthread{[loop = server_loop] { loop->run(); }};
    target = server->address();
  } else {
    target = parse_address(args.get("client", ""));
  }

  int status = 0;
  for (const auto size : sizes) {
    auto options = base;
    options.size = size;
    RunResult r;
    try {
      r = run_client(options, target);
    } catch (const std::exception& e) {
      r.ok = false;
      r.error = e.what();
    }
    const std::string what =
        fmt::format("{} {} {} {} {} B x{} conn{}", common.backend, common.mode,
                    to_string(options.send), test, size, options.connections,
                    options.threads > 0 ? fmt::format(" {} threads", options.threads) : "");
    if (!r.ok) {
      std::cout << fmt::format("{}: FAILED: {}", what, r.error) << std::endl;
      status = std::max(status, EXIT_ERROR);
    } else {
      const std::string cpu = loopback
                                  ? fmt::format("cpu {:.0f} ns/msg (both ends)", r.cpu_ns_per_msg)
                                  : fmt::format("cpu {:.0f} ns/msg (server {:.0f})",
                                                r.cpu_ns_per_msg, r.server_cpu_ns_per_msg);
      if (options.test == Test::LATENCY) {
        std::cout << fmt::format(
            "{}: {:.0f} round trips/s, round trip p50 {:.2f} us, p99 {:.2f} us, p99.9 {:.2f} us, "
            "{}, {}",
            what, r.msgs_per_s, *r.p50_us, *r.p99_us, *r.p999_us, cpu,
            r.intact ? "intact" : "NOT INTACT: " + r.error);
      } else {
        std::cout << fmt::format("{}: {:.0f} msg/s, {:.1f} MB/s, {:.3f} Gbit/s, {}, {}", what,
                                 r.msgs_per_s, r.bytes_per_s / 1e6, r.bytes_per_s * 8 / 1e9, cpu,
                                 r.intact ? "intact" : "NOT INTACT: " + r.error);
      }
      if (options.on_ready) std::cout << fmt::format(", {} ready callbacks", r.ready_callbacks);
      std::cout << fmt::format(", set-up {:.0f} us{}", r.setup_us,
                               options.partition_key.empty() ? "" : " (partition key)");
      std::cout << std::endl;
      if (r.stats) {
        const auto& s = *r.stats;
        std::cout << fmt::format(
                         "  stats: connections closed {}, sends accepted {} completed {} "
                         "cancelled {} no_resources {} failed {}, bytes sent {}, in flight {}, "
                         "queued {} B, received {} messages {} B",
                         s.connections_closed, s.sends_accepted, s.sends_completed,
                         s.sends_cancelled, s.sends_no_resources, s.sends_failed, s.bytes_sent,
                         s.keys_in_flight, s.bytes_queued, s.messages_received, s.bytes_received)
                  << std::endl;
      }
      if (!r.intact) status = std::max(status, EXIT_LOST);
    }
    if (!json_path.empty()) {
      std::ofstream json{json_path, std::ios::app};
      json
          << fmt::format(
                 R"({{"tool":"netio3-perf","backend":"{}","mode":"{}","send":"{}","test":"{}",)"
                 R"("size":{},"connections":{},"threads":{},"window":{},"same_buffer":{},"loopback":{},)"
                 R"("duration_s":{:.6g},"messages":{},"bytes":{},"msgs_per_s":{},"bytes_per_s":{},)"
                 R"("gbit_per_s":{},"cpu_ns_per_msg":{},"server_cpu_ns_per_msg":{},)"
                 R"("p50_us":{},"p99_us":{},"p999_us":{},"setup_us":{},"partition_key":{},"intact":{},)"
                 R"("error":{}}})",
                 common.backend, common.mode, to_string(options.send), test, size,
                 options.connections, options.threads, r.window, options.same_buffer, loopback,
                 r.seconds, r.messages, r.bytes,
                 json_number(r.ok ? std::optional{r.msgs_per_s} : std::nullopt),
                 json_number(r.ok ? std::optional{r.bytes_per_s} : std::nullopt),
                 json_number(r.ok ? std::optional{r.bytes_per_s * 8 / 1e9} : std::nullopt),
                 json_number(r.ok ? std::optional{r.cpu_ns_per_msg} : std::nullopt),
                 json_number(r.ok && !loopback ? std::optional{r.server_cpu_ns_per_msg}
                                               : std::nullopt),
                 json_number(r.p50_us), json_number(r.p99_us), json_number(r.p999_us),
                 json_number(r.ok ? std::optional{r.setup_us} : std::nullopt),
                 !options.partition_key.empty(), r.ok && r.intact, json_string(r.error))
          << '\n';
      if (!json) {
        std::cerr << fmt::format("netio3-perf: cannot write {}\n", json_path);
        status = std::max(status, EXIT_ERROR);
      }
    }
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse_args(argc, argv);
    if (args.flag("help")) {
      std::cout << USAGE;
      return 0;
    }
    if (args.flag("list-backends")) {
      for (const auto type : Netio3Backend::available()) std::cout << to_string(type) << '\n';
      return 0;
    }
    const bool server = args.flag("server");
    const bool client = args.values.contains("client");
    if (int{server} + int{client} + int{args.flag("loopback")} > 1) {
      throw UsageError{"choose one of --server, --client and --loopback"};
    }
    if (server) return run_server(args);
    return run_clients(args, !client);
  } catch (const UsageError& e) {
    std::cerr << "netio3-perf: " << e.what() << "\n" << USAGE;
    return EXIT_USAGE;
  } catch (const std::exception& e) {
    std::cerr << "netio3-perf: " << e.what() << '\n';
    return EXIT_ERROR;
  }
}
