// netio3-raw-zmq: the ZeroMQ reference for bench/compare. The same measurement as
// netio3-perf, written directly against the libzmq C API with default socket options
// (except the high-water marks, see below), over TCP between two processes.
//
//   netio3-raw-zmq --server [--bind 127.0.0.1] [--port 0]
//   netio3-raw-zmq --client IP:PORT --test throughput|latency --size BYTES
//                  --duration SECONDS [--json FILE]
//
// Design. The server binds one control socket (ROUTER) on the printed port and serves one
// client after another until SIGTERM/SIGINT. A client (REQ on the control socket) asks for
// a session ("throughput SIZE" or "latency SIZE"); the server binds a fresh data socket for
// it on a port the OS picks, with high-water marks sized for SIZE, and answers "ok PORT".
//
//   throughput  the client PUSHes SIZE-byte messages to the server's PULL socket for
//               --duration seconds. The first 8 bytes of each message (fewer if SIZE < 8)
//               are its sequence number (little endian); the server checks sequence and
//               length of every message. After the last message the client pushes an end
//               marker (16 bytes: ~0, count) and asks for the report on the control socket;
//               the server answers once it has seen the end marker: received count, bytes,
//               whether everything was in order, and its CPU time. The rate is end to end:
//               first send -> report received.
//   latency     REQ/REP ping-pong of SIZE-byte messages on a second socket pair; the server
//               echoes, the client checks the echo and times each round trip. Percentiles
//               are of the ROUND TRIP time. A 0.2 s warm-up is not counted.
//
// High-water marks: the default 1000 messages would cap the 64 B pipeline needlessly and
// queue 1 GiB at 1 MiB; both sides use max(16, min(100000, 64 MiB / SIZE)) messages.
//
// cpu_ns_per_msg is the CPU time of the client process (all its threads, including zmq's I/O
// thread) during the run, divided by the messages (round trips for latency);
// server_cpu_ns_per_msg the same for the server process, from its report.
//
// Output: one human line per run; with --json FILE one JSON object per run appended to FILE
// (JSON Lines, the keys shared by all bench/compare programs).
// Exit status: 0 intact, 1 data lost/corrupted/reordered or a peer failed, 2 bad options.

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <optional>
#include <signal.h>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>
#include <zmq.h>

#include <fmt/format.h>

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kEndMagic = ~std::uint64_t{0};
constexpr std::size_t kEndMarkerSize = 16;
constexpr int kPollMs = 200;
constexpr auto kIdleTimeout = std::chrono::seconds{10};
constexpr int kCtrlTimeoutMs = 30000;
constexpr int kDataTimeoutMs = 10000;

volatile std::sig_atomic_t g_stop = 0;

extern "C" void on_signal(int /*signal*/) {
  g_stop = 1;
}

struct UsageError {
  std::string what;
};

struct Options {
  bool server = false;
  std::string bind_ip = "127.0.0.1";
  std::uint16_t port = 0;
  std::string connect;  // IP:PORT
  std::string test = "throughput";
  std::size_t size = 64;
  double duration = 5.0;
  std::string json;
};

std::uint64_t process_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ULL +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

int hwm_for(std::size_t size) {
  const std::size_t by_memory = (std::size_t{64} << 20) / std::max<std::size_t>(size, 1);
  return static_cast<int>(std::clamp<std::size_t>(by_memory, 16, 100000));
}

template <typename T>
T parse_number(std::string_view text, std::string_view option) {
  T value{};
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc{} || ptr != end) {
    throw UsageError{fmt::format("bad value for {}: '{}'", option, text)};
  }
  return value;
}

double parse_double(std::string_view text, std::string_view option) {
  try {
    std::size_t used = 0;
    const double value = std::stod(std::string{text}, &used);
    if (used != text.size()) throw UsageError{};
    return value;
  } catch (...) {
    throw UsageError{fmt::format("bad value for {}: '{}'", option, text)};
  }
}

Options parse_options(int argc, char** argv) {
  Options options;
  bool client = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw UsageError{fmt::format("{} needs a value", arg)};
      return argv[++i];
    };
    if (arg == "--server") {
      options.server = true;
    } else if (arg == "--bind") {
      options.bind_ip = value();
    } else if (arg == "--port") {
      options.port = parse_number<std::uint16_t>(value(), arg);
    } else if (arg == "--client") {
      client = true;
      options.connect = value();
    } else if (arg == "--test") {
      options.test = value();
      if (options.test != "throughput" && options.test != "latency") {
        throw UsageError{"--test must be throughput or latency"};
      }
    } else if (arg == "--size") {
      options.size = parse_number<std::size_t>(value(), arg);
      if (options.size == 0) throw UsageError{"--size must be at least 1"};
    } else if (arg == "--duration") {
      options.duration = parse_double(value(), arg);
      if (!(options.duration > 0)) throw UsageError{"--duration must be positive"};
    } else if (arg == "--json") {
      options.json = value();
    } else {
      throw UsageError{fmt::format("unknown option '{}'", arg)};
    }
  }
  if (options.server == client) throw UsageError{"give exactly one of --server, --client"};
  if (client && options.connect.find(':') == std::string::npos) {
    throw UsageError{"--client needs IP:PORT"};
  }
  return options;
}

// ---- small RAII wrappers over the C API ---------------------------------------------------

class Context {
 public:
  Context() : ctx_{zmq_ctx_new()} {}
  ~Context() { zmq_ctx_term(ctx_); }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  void* get() const { return ctx_; }

 private:
  void* ctx_;
};

class Socket {
 public:
  Socket(const Context& ctx, int type) : sock_{zmq_socket(ctx.get(), type)} {
    if (sock_ == nullptr) throw std::runtime_error{error("zmq_socket")};
    set(ZMQ_LINGER, 0);
  }
  ~Socket() {
    if (sock_ != nullptr) zmq_close(sock_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  void* get() const { return sock_; }
  void set(int option, int value) {
    if (zmq_setsockopt(sock_, option, &value, sizeof value) != 0) {
      throw std::runtime_error{error("zmq_setsockopt")};
    }
  }
  void bind(const std::string& endpoint) {
    if (zmq_bind(sock_, endpoint.c_str()) != 0) {
      throw std::runtime_error{error(fmt::format("zmq_bind {}", endpoint))};
    }
  }
  void connect(const std::string& endpoint) {
    if (zmq_connect(sock_, endpoint.c_str()) != 0) {
      throw std::runtime_error{error(fmt::format("zmq_connect {}", endpoint))};
    }
  }
  // The port of the last bind (the OS's pick for "tcp://IP:*").
  std::uint16_t bound_port() const {
    char endpoint[256] = {};
    std::size_t length = sizeof endpoint;
    if (zmq_getsockopt(sock_, ZMQ_LAST_ENDPOINT, endpoint, &length) != 0) {
      throw std::runtime_error{error("ZMQ_LAST_ENDPOINT")};
    }
    const std::string_view text{endpoint};
    return parse_number<std::uint16_t>(text.substr(text.rfind(':') + 1), "endpoint");
  }

  static std::string error(std::string_view what) {
    return fmt::format("{}: {}", what, zmq_strerror(zmq_errno()));
  }

 private:
  void* sock_;
};

class Message {
 public:
  Message() { zmq_msg_init(&msg_); }
  ~Message() { zmq_msg_close(&msg_); }
  Message(const Message&) = delete;
  Message& operator=(const Message&) = delete;
  zmq_msg_t* get() { return &msg_; }
  std::size_t size() { return zmq_msg_size(&msg_); }
  const unsigned char* data() { return static_cast<const unsigned char*>(zmq_msg_data(&msg_)); }
  std::string_view text() { return {reinterpret_cast<const char*>(data()), size()}; }

 private:
  zmq_msg_t msg_{};
};

void put_u64(unsigned char* out, std::uint64_t value, std::size_t bytes) {
  for (std::size_t i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(value >> (8 * i));
}

std::uint64_t get_u64(const unsigned char* in, std::size_t bytes) {
  std::uint64_t value = 0;
  for (std::size_t i = 0; i < bytes; ++i) value |= std::uint64_t{in[i]} << (8 * i);
  return value;
}

bool send_text(void* sock, std::string_view text, int flags = 0) {
  return zmq_send(sock, text.data(), text.size(), flags) >= 0;
}

// ---- server ----------------------------------------------------------------------------------

// A request on the ROUTER control socket: the client's identity and the request text.
struct Request {
  std::string identity;
  std::string text;
};

// Receives one request if one is waiting (non-blocking). Malformed frames are dropped.
std::optional<Request> receive_request(void* ctrl) {
  std::vector<std::string> frames;
  int more = 0;
  do {
    Message part;
    if (zmq_msg_recv(part.get(), ctrl, ZMQ_DONTWAIT) < 0) {
      if (frames.empty()) return std::nullopt;
      break;  // rest of a multipart message is always there once its first part is
    }
    frames.emplace_back(part.text());
    more = zmq_msg_more(part.get());
  } while (more != 0);
  if (frames.size() != 3 || !frames[1].empty()) return std::nullopt;
  return Request{frames[0], frames[2]};
}

void reply(void* ctrl, const Request& request, std::string_view text) {
  send_text(ctrl, request.identity, ZMQ_SNDMORE);
  send_text(ctrl, "", ZMQ_SNDMORE);
  send_text(ctrl, text);
}

struct ThroughputState {
  std::size_t size = 0;
  std::uint64_t received = 0;
  std::uint64_t bytes = 0;
  bool in_order = true;
  bool ended = false;
  std::uint64_t end_count = 0;
  std::optional<Request> report_request;
};

void check_data(ThroughputState& state, Message& msg) {
  const std::size_t size = msg.size();
  if (size == kEndMarkerSize && get_u64(msg.data(), 8) == kEndMagic) {
    state.ended = true;
    state.end_count = get_u64(msg.data() + 8, 8);
    return;
  }
  const std::size_t seq_bytes = std::min<std::size_t>(8, state.size);
  std::uint64_t expected = state.received;
  if (seq_bytes < 8) expected &= (std::uint64_t{1} << (8 * seq_bytes)) - 1;
  if (size != state.size || get_u64(msg.data(), std::min(seq_bytes, size)) != expected) {
    state.in_order = false;
  }
  ++state.received;
  state.bytes += size;
}

// A session request ("throughput SIZE", "latency SIZE") while a session runs means that its
// client went away without finishing (clients come one after another): the session ends and
// the request is served next.
bool is_session_request(const Request& request) {
  return request.text.starts_with("throughput ") || request.text.starts_with("latency ");
}

void abandon(const char* what) {
  std::fprintf(stderr, "netio3-raw-zmq: %s session abandoned for a new client\n", what);
}

std::optional<Request> serve_throughput(const Context& ctx, Socket& ctrl, const Options& options,
                                        const Request& start, std::size_t size) {
  Socket pull{ctx, ZMQ_PULL};
  pull.set(ZMQ_RCVHWM, hwm_for(size));
  pull.bind(fmt::format("tcp://{}:*", options.bind_ip));
  const std::uint64_t cpu_start = process_cpu_ns();
  reply(ctrl.get(), start, fmt::format("ok {}", pull.bound_port()));

  ThroughputState state;
  state.size = size;
  auto last_activity = Clock::now();
  zmq_pollitem_t items[] = {{pull.get(), 0, ZMQ_POLLIN, 0}, {ctrl.get(), 0, ZMQ_POLLIN, 0}};
  while (g_stop == 0 && !(state.ended && state.report_request)) {
    if (Clock::now() - last_activity > kIdleTimeout) {
      std::fprintf(stderr, "netio3-raw-zmq: session idle for 10 s, ending it\n");
      state.in_order = state.in_order && state.ended;
      break;
    }
    if (zmq_poll(items, 2, kPollMs) < 0) continue;  // EINTR: look at g_stop
    if ((items[0].revents & ZMQ_POLLIN) != 0) {
      last_activity = Clock::now();
      for (int i = 0; i < 4096 && !state.ended; ++i) {
        Message msg;
        if (zmq_msg_recv(msg.get(), pull.get(), ZMQ_DONTWAIT) < 0) break;
        check_data(state, msg);
      }
    }
    if ((items[1].revents & ZMQ_POLLIN) != 0) {
      while (auto request = receive_request(ctrl.get())) {
        last_activity = Clock::now();
        if (request->text == "report") {
          state.report_request = std::move(request);
        } else if (is_session_request(*request)) {
          abandon("throughput");
          return request;
        } else {
          reply(ctrl.get(), *request, "error bad request");
        }
      }
    }
  }
  const bool intact = state.ended && state.in_order && state.end_count == state.received;
  if (state.report_request) {
    reply(ctrl.get(), *state.report_request,
          fmt::format("report {} {} {} {}", state.received, state.bytes, intact ? 1 : 0,
                      process_cpu_ns() - cpu_start));
  }
  return std::nullopt;
}

std::optional<Request> serve_latency(const Context& ctx, Socket& ctrl, const Options& options,
                                     const Request& start, std::size_t size) {
  Socket rep{ctx, ZMQ_REP};
  rep.set(ZMQ_RCVHWM, hwm_for(size));
  rep.set(ZMQ_SNDHWM, hwm_for(size));
  rep.bind(fmt::format("tcp://{}:*", options.bind_ip));
  const std::uint64_t cpu_start = process_cpu_ns();
  reply(ctrl.get(), start, fmt::format("ok {}", rep.bound_port()));

  // The echo loop blocks in zmq_msg_recv, the way a REP server is usually written; the
  // control socket is looked at when the data socket has been quiet for kPollMs.
  rep.set(ZMQ_RCVTIMEO, kPollMs);
  auto last_activity = Clock::now();
  while (g_stop == 0) {
    Message msg;
    if (zmq_msg_recv(msg.get(), rep.get(), 0) >= 0) {
      if (zmq_msg_send(msg.get(), rep.get(), 0) < 0) {
        std::fprintf(stderr, "netio3-raw-zmq: %s\n", Socket::error("echo").c_str());
        return std::nullopt;
      }
      last_activity = Clock::now();
      continue;
    }
    const int error = zmq_errno();
    if (error != EAGAIN && error != EINTR) {
      std::fprintf(stderr, "netio3-raw-zmq: %s\n", Socket::error("zmq_msg_recv").c_str());
      return std::nullopt;
    }
    while (auto request = receive_request(ctrl.get())) {
      if (request->text == "done") {
        reply(ctrl.get(), *request, fmt::format("done {}", process_cpu_ns() - cpu_start));
        return std::nullopt;
      }
      if (is_session_request(*request)) {
        abandon("latency");
        return request;
      }
      reply(ctrl.get(), *request, "error bad request");
    }
    if (Clock::now() - last_activity > kIdleTimeout) {
      std::fprintf(stderr, "netio3-raw-zmq: session idle for 10 s, ending it\n");
      return std::nullopt;
    }
  }
  return std::nullopt;
}

int run_server(const Options& options) {
  Context ctx;
  Socket ctrl{ctx, ZMQ_ROUTER};
  ctrl.bind(options.port == 0 ? fmt::format("tcp://{}:*", options.bind_ip)
                              : fmt::format("tcp://{}:{}", options.bind_ip, options.port));
  std::printf("listening on %s:%u\n", options.bind_ip.c_str(), unsigned{ctrl.bound_port()});
  std::fflush(stdout);

  std::optional<Request> next;  // a request that ended the previous session
  zmq_pollitem_t items[] = {{ctrl.get(), 0, ZMQ_POLLIN, 0}};
  while (g_stop == 0) {
    std::optional<Request> request = std::move(next);
    next.reset();
    if (!request) {
      if (zmq_poll(items, 1, kPollMs) <= 0) continue;
      request = receive_request(ctrl.get());
      if (!request) continue;
    }
    const std::string_view text = request->text;
    const auto space = text.find(' ');
    const std::string_view kind = text.substr(0, space);
    std::size_t size = 0;
    try {
      if (space == std::string_view::npos) throw UsageError{};
      size = parse_number<std::size_t>(text.substr(space + 1), "size");
      if (size == 0) throw UsageError{};
    } catch (const UsageError&) {
      reply(ctrl.get(), *request, "error bad request");
      continue;
    }
    try {
      if (kind == "throughput") {
        next = serve_throughput(ctx, ctrl, options, *request, size);
      } else if (kind == "latency") {
        next = serve_latency(ctx, ctrl, options, *request, size);
      } else {
        reply(ctrl.get(), *request, "error bad request");
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "netio3-raw-zmq: session failed: %s\n", e.what());
      reply(ctrl.get(), *request, fmt::format("error {}", e.what()));
    }
  }
  return 0;
}

// ---- client ----------------------------------------------------------------------------------

struct Result {
  std::string test;
  std::string send;
  std::size_t size = 0;
  double duration_s = 0;
  std::uint64_t messages = 0;
  std::uint64_t bytes = 0;
  std::uint64_t cpu_ns = 0;         // this (the client) process
  std::uint64_t server_cpu_ns = 0;  // the server process, from its report
  std::optional<double> p50_us, p99_us, p999_us;
  bool intact = false;
  std::string error;
};

std::string json_number(std::optional<double> value) {
  return value ? fmt::format("{:.3f}", *value) : std::string{"null"};
}

void report(const Options& options, const Result& r) {
  const double msgs_per_s = r.duration_s > 0 ? static_cast<double>(r.messages) / r.duration_s : 0;
  const double bytes_per_s = r.duration_s > 0 ? static_cast<double>(r.bytes) / r.duration_s : 0;
  auto per_msg = [&](std::uint64_t ns) {
    return r.messages > 0 ? static_cast<double>(ns) / static_cast<double>(r.messages) : 0.0;
  };
  const double cpu_per_msg = per_msg(r.cpu_ns);
  const double server_cpu_per_msg = per_msg(r.server_cpu_ns);
  std::string line = fmt::format(
      "zmq tcp {} {} size={} B: {} {} in {:.2f} s, {:.0f} msg/s, {:.1f} MB/s ({:.3f} Gbit/s), "
      "cpu {:.0f} ns/msg (server {:.0f})",
      r.send, r.test, r.size, r.messages, r.test == "latency" ? "round trips" : "messages",
      r.duration_s, msgs_per_s, bytes_per_s / 1e6, bytes_per_s * 8 / 1e9, cpu_per_msg,
      server_cpu_per_msg);
  if (r.p50_us) {
    line += fmt::format(", round trip p50 {:.2f} us p99 {:.2f} us p99.9 {:.2f} us", *r.p50_us,
                        *r.p99_us, *r.p999_us);
  }
  line +=
      r.intact ? ", intact" : fmt::format(", NOT INTACT{}{}", r.error.empty() ? "" : ": ", r.error);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);

  if (options.json.empty()) return;
  const std::string json = fmt::format(
      "{{\"tool\":\"zmq\",\"backend\":\"zmq\",\"mode\":\"tcp\",\"send\":\"{}\",\"test\":\"{}\","
      "\"size\":{},\"connections\":1,\"threads\":1,\"duration_s\":{:.6f},\"messages\":{},"
      "\"bytes\":{},\"msgs_per_s\":{:.3f},\"bytes_per_s\":{:.3f},\"gbit_per_s\":{:.6f},"
      "\"cpu_ns_per_msg\":{:.3f},\"server_cpu_ns_per_msg\":{:.3f},\"p50_us\":{},\"p99_us\":{},"
      "\"p999_us\":{},\"intact\":{}}}\n",
      r.send, r.test, r.size, r.duration_s, r.messages, r.bytes, msgs_per_s, bytes_per_s,
      bytes_per_s * 8 / 1e9, cpu_per_msg, server_cpu_per_msg, json_number(r.p50_us),
      json_number(r.p99_us), json_number(r.p999_us), r.intact ? "true" : "false");
  std::FILE* file = std::fopen(options.json.c_str(), "a");
  if (file == nullptr) {
    std::fprintf(stderr, "netio3-raw-zmq: cannot open %s: %s\n", options.json.c_str(),
                 std::strerror(errno));
    return;
  }
  std::fputs(json.c_str(), file);
  std::fclose(file);
}

// Sends a request on the REQ control socket and waits for the answer (kCtrlTimeoutMs).
std::string ask(Socket& ctrl, std::string_view request) {
  if (!send_text(ctrl.get(), request)) throw std::runtime_error{Socket::error("control send")};
  Message answer;
  if (zmq_msg_recv(answer.get(), ctrl.get(), 0) < 0) {
    throw std::runtime_error{Socket::error(fmt::format("no answer to '{}'", request))};
  }
  return std::string{answer.text()};
}

std::string open_session(Socket& ctrl, const std::string& host, const std::string& request) {
  const std::string answer = ask(ctrl, request);
  if (!answer.starts_with("ok ")) {
    throw std::runtime_error{fmt::format("server refused '{}': {}", request, answer)};
  }
  return fmt::format("tcp://{}:{}", host, answer.substr(3));
}

Result run_throughput(const Context& ctx, Socket& ctrl, const Options& options,
                      const std::string& host) {
  Result r;
  r.test = "throughput";
  r.send = "push-pull";
  r.size = options.size;
  const std::string endpoint = open_session(ctrl, host, fmt::format("throughput {}", options.size));
  Socket push{ctx, ZMQ_PUSH};
  push.set(ZMQ_SNDHWM, hwm_for(options.size));
  push.set(ZMQ_SNDTIMEO, kDataTimeoutMs);  // a server that went away must not hang us
  push.connect(endpoint);

  std::vector<unsigned char> buffer(options.size);
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<unsigned char>(i * 7);
  const std::size_t seq_bytes = std::min<std::size_t>(8, options.size);
  const auto duration = std::chrono::duration<double>(options.duration);

  const std::uint64_t cpu_start = process_cpu_ns();
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(duration);
  std::uint64_t sent = 0;
  for (;;) {
    if ((sent & 63) == 0 && (Clock::now() >= deadline || g_stop != 0)) break;
    put_u64(buffer.data(), sent, seq_bytes);
    if (zmq_send(push.get(), buffer.data(), buffer.size(), 0) < 0) {
      if (zmq_errno() == EINTR) continue;
      r.error = zmq_errno() == EAGAIN ? std::string{"send blocked for 10 s (server gone?)"}
                                      : Socket::error("zmq_send");
      break;
    }
    ++sent;
  }
  if (g_stop != 0 && r.error.empty()) r.error = "interrupted";
  unsigned char end_marker[kEndMarkerSize];
  put_u64(end_marker, kEndMagic, 8);
  put_u64(end_marker + 8, sent, 8);
  if (r.error.empty() && zmq_send(push.get(), end_marker, sizeof end_marker, 0) < 0) {
    r.error = Socket::error("zmq_send end marker");
  }
  std::string answer;
  if (r.error.empty()) {
    try {
      ctrl.set(ZMQ_RCVTIMEO, kCtrlTimeoutMs);  // the server may still drain its queue
      answer = ask(ctrl, "report");
    } catch (const std::exception& e) {
      r.error = e.what();
    }
  }
  const auto end = Clock::now();
  r.duration_s = std::chrono::duration<double>(end - start).count();
  r.cpu_ns = process_cpu_ns() - cpu_start;
  r.messages = sent;
  r.bytes = sent * options.size;

  unsigned long long received = 0, bytes = 0, server_cpu = 0;
  int intact = 0;
  if (r.error.empty()) {
    if (std::sscanf(answer.c_str(), "report %llu %llu %d %llu", &received, &bytes, &intact,
                    &server_cpu) != 4) {
      r.error = fmt::format("bad report '{}'", answer);
    } else if (intact == 0 || received != sent || bytes != r.bytes) {
      r.error = fmt::format("server received {} of {} messages, {} of {} bytes{}", received, sent,
                            bytes, r.bytes, intact == 0 ? ", out of order or damaged" : "");
    }
  }
  r.server_cpu_ns = server_cpu;
  r.intact = r.error.empty();
  return r;
}

Result run_latency(const Context& ctx, Socket& ctrl, const Options& options,
                   const std::string& host) {
  Result r;
  r.test = "latency";
  r.send = "req-rep";
  r.size = options.size;
  const std::string endpoint = open_session(ctrl, host, fmt::format("latency {}", options.size));
  Socket req{ctx, ZMQ_REQ};
  req.set(ZMQ_RCVTIMEO, kDataTimeoutMs);
  req.set(ZMQ_SNDTIMEO, kDataTimeoutMs);
  req.connect(endpoint);

  std::vector<unsigned char> buffer(options.size);
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<unsigned char>(i * 7);
  const std::size_t seq_bytes = std::min<std::size_t>(8, options.size);
  std::vector<std::uint64_t> samples;
  samples.reserve(1 << 20);

  auto round_trip = [&](std::uint64_t seq) -> bool {
    put_u64(buffer.data(), seq, seq_bytes);
    if (zmq_send(req.get(), buffer.data(), buffer.size(), 0) < 0) {
      r.error = Socket::error("zmq_send");
      return false;
    }
    Message echo;
    if (zmq_msg_recv(echo.get(), req.get(), 0) < 0) {
      r.error = Socket::error("no echo");
      return false;
    }
    if (echo.size() != buffer.size() || std::memcmp(echo.data(), buffer.data(), seq_bytes) != 0) {
      r.error = fmt::format("echo {} differs", seq);
      return false;
    }
    return true;
  };

  std::uint64_t seq = 0;
  const auto warmup_end = Clock::now() + std::chrono::milliseconds{200};
  bool ok = true;
  while (ok && g_stop == 0 && Clock::now() < warmup_end) ok = round_trip(seq++);

  const auto duration = std::chrono::duration<double>(options.duration);
  const std::uint64_t cpu_start = process_cpu_ns();
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(duration);
  auto now = start;
  while (ok && g_stop == 0 && now < deadline) {
    const auto before = now;
    ok = round_trip(seq++);
    now = Clock::now();
    if (ok) {
      samples.push_back(static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(now - before).count()));
    }
  }
  if (g_stop != 0 && r.error.empty()) r.error = "interrupted";
  r.duration_s = std::chrono::duration<double>(now - start).count();
  r.cpu_ns = process_cpu_ns() - cpu_start;
  r.messages = samples.size();
  r.bytes = r.messages * options.size;

  if (r.error.empty()) {
    try {
      const std::string answer = ask(ctrl, "done");
      unsigned long long server_cpu = 0;
      if (std::sscanf(answer.c_str(), "done %llu", &server_cpu) == 1) r.server_cpu_ns = server_cpu;
    } catch (const std::exception& e) {
      r.error = e.what();
    }
  }
  if (!samples.empty()) {
    std::sort(samples.begin(), samples.end());
    auto percentile = [&](double p) {
      const auto index = static_cast<std::size_t>(p * static_cast<double>(samples.size() - 1));
      return static_cast<double>(samples[index]) / 1000.0;
    };
    r.p50_us = percentile(0.50);
    r.p99_us = percentile(0.99);
    r.p999_us = percentile(0.999);
  } else if (r.error.empty()) {
    r.error = "no round trips";
  }
  r.intact = r.error.empty();
  return r;
}

int run_client(const Options& options) {
  const auto colon = options.connect.rfind(':');
  const std::string host = options.connect.substr(0, colon);
  Context ctx;
  Socket ctrl{ctx, ZMQ_REQ};
  ctrl.set(ZMQ_RCVTIMEO, kDataTimeoutMs);
  ctrl.connect(fmt::format("tcp://{}", options.connect));
  Result r;
  try {
    r = options.test == "latency" ? run_latency(ctx, ctrl, options, host)
                                  : run_throughput(ctx, ctrl, options, host);
  } catch (const std::exception& e) {
    r.test = options.test;
    r.send = options.test == "latency" ? "req-rep" : "push-pull";
    r.size = options.size;
    r.error = e.what();
    r.intact = false;
  }
  report(options, r);
  return r.intact ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_options(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr,
                 "netio3-raw-zmq: %s\n"
                 "usage: netio3-raw-zmq --server [--bind 127.0.0.1] [--port 0]\n"
                 "       netio3-raw-zmq --client IP:PORT --test throughput|latency "
                 "--size BYTES --duration SECONDS [--json FILE]\n",
                 e.what.c_str());
    return 2;
  }
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  try {
    return options.server ? run_server(options) : run_client(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "netio3-raw-zmq: %s\n", e.what());
    return 1;
  }
}
