// netio3_fault_peer: the other end of a connection for the fault tests, in its own process so
// that a test can kill it, stop it, or put it into another network namespace.
//
//   netio3_fault_peer --backend NAME --role send|recv (--listen IP | --connect IP:PORT)
//                     [--messages N] [--size BYTES] [--mode buffered|zerocopy|copy]
//                     [--stream ID] [--progress K] [--timeout SECONDS]
//                     [--peer-timeout-ms MS] [--port P] [--session 0|1]
//                     [--session-max-delay-ms MS] [--give-up-ms MS] [--rate MSG_PER_S]
//
// --rate paces a sender (slices of 100 messages, each no earlier than the rate allows): a
// stream that lasts as long as a test's sequence of faults, whatever the machine's speed.
// It makes one connection (listening on IP at a port the OS chooses, or connecting) and
// then, as receiver, checks that stream ID arrives in order and intact, or, as sender, sends
// stream ID. N = 0 means until the connection closes (or the process is killed). With N > 0
// a sender closes the connection once its N sends completed; a receiver waits for that.
//
// It writes one line per event on stdout, each flushed at once (a test reads them while the
// peer runs, and a SIGKILL must not lose what was written):
//
//   PORT <port>                       listening (--listen)
//   ESTABLISHED <remote>
//   RECEIVED <n> / SENT <n>           every K messages (--progress K)
//   BAD <what>                        the first message that broke the stream
//   DONE received=<n> bad=<n>         receiver: N messages arrived
//   DONE sent=<n>                     sender: N sends completed
//   CLOSED at_us=<t> remote=... cancelled=<n> received=<n> bad=<n> cause=<CloseCause>
//                                     the closed callback; t is CLOCK_MONOTONIC in us
//   LEDGER ok=... completed=... cancelled=... unreported=... violations=...
//   INTERRUPTED at_us=<t> reason=...  a session's transport broke (--session)
//   RESUMED at_us=<t> outage_ms=<ms>  and was resumed
//   CANCELLED count=<n> first=<key> last=<key> contiguous=<0|1>
//                                     sender: the keys its closed callback listed
//   END <reason>
//
// Exit status: 0 everything as expected, 1 a broken stream or key ledger, 2 bad usage,
// 3 deadline passed, 4 the connection could not be made.

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "fault_stream.hpp"
#include "test_support.hpp"

namespace {

using netio3::faults::Clock;
using netio3::faults::ConnectionState;
using netio3::faults::Observer;
using netio3::faults::SendMode;

std::mutex g_print_mutex;

void print_line(const std::string& line) {
  const std::lock_guard lock{g_print_mutex};
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

struct Options {
  netio3::BackendType backend{netio3::BackendType::ASYNCMSG};
  bool send{false};
  std::optional<std::string> listen;
  std::optional<netio3::EndPointAddress> connect;
  std::uint64_t messages{0};
  std::size_t size{4096};
  SendMode mode{SendMode::ZERO_COPY};
  netio3::NetworkMode network{netio3::NetworkMode::TCP};
  std::uint64_t stream{1};
  std::uint64_t progress{0};
  std::chrono::seconds timeout{60};
  std::optional<std::chrono::milliseconds> peer_timeout;  // limits.peer_timeout
  bool undumpable{false};  // prctl(PR_SET_DUMPABLE, 0) first: no process may read this one
  std::uint16_t port{0};   // --listen at this port
  bool session{false};     // delivery.session on the connection it opens
  std::chrono::milliseconds session_max_delay{2000};
  std::chrono::milliseconds give_up{60000};
  std::uint64_t rate{0};  // messages per second (0: as fast as it goes)
};

template <typename T>
std::optional<T> parse_number(std::string_view text) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "netio3_fault_peer: %s\nusage: netio3_fault_peer --backend NAME --role send|recv "
               "(--listen IP | --connect IP:PORT) [--messages N] [--size BYTES] "
               "[--mode buffered|zerocopy|copy] [--network tcp|rdma] [--stream ID] [--progress K] "
               "[--timeout SECONDS] [--peer-timeout-ms MS] [--undumpable 0|1] [--port P] "
               "[--session 0|1] [--session-max-delay-ms MS] [--give-up-ms MS] [--rate N]\n",
               why.c_str());
  std::exit(2);  // NOLINT(concurrency-mt-unsafe): before any thread exists
}

Options parse(int argc, char** argv) {
  Options o;
  bool have_backend = false;
  bool have_role = false;
  const std::vector<std::string_view> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view name = args[i];
    if (i + 1 >= args.size()) usage(fmt::format("{} needs a value", name));
    const std::string_view value = args[++i];
    if (name == "--backend") {
      const auto type = netio3::parse_backend_type(value);
      if (!type) usage(fmt::format("unknown backend '{}'", value));
      o.backend = *type;
      have_backend = true;
    } else if (name == "--undumpable") {
      if (value != "0" && value != "1") usage("--undumpable is 0 or 1");
      o.undumpable = value == "1";
    } else if (name == "--role") {
      if (value != "send" && value != "recv") usage("--role is send or recv");
      o.send = value == "send";
      have_role = true;
    } else if (name == "--listen") {
      o.listen = std::string{value};
    } else if (name == "--connect") {
      const auto colon = value.rfind(':');
      const auto port = colon == std::string_view::npos
                            ? std::nullopt
                            : parse_number<std::uint16_t>(value.substr(colon + 1));
      if (!port) usage(fmt::format("--connect {}: not IP:PORT", value));
      o.connect = netio3::EndPointAddress{std::string{value.substr(0, colon)}, *port};
    } else if (name == "--messages") {
      const auto n = parse_number<std::uint64_t>(value);
      if (!n) usage("--messages: not a number");
      o.messages = *n;
    } else if (name == "--size") {
      const auto n = parse_number<std::size_t>(value);
      if (!n || *n < netio3::faults::HEADER_BYTES) usage("--size: a number >= 16");
      o.size = *n;
    } else if (name == "--network") {
      const auto network = netio3::parse_network_mode(value);
      if (!network) usage(fmt::format("unknown network mode '{}'", value));
      o.network = *network;
    } else if (name == "--mode") {
      const auto mode = netio3::faults::parse_send_mode(value);
      if (!mode) usage(fmt::format("unknown send mode '{}'", value));
      o.mode = *mode;
    } else if (name == "--stream") {
      const auto n = parse_number<std::uint64_t>(value);
      if (!n) usage("--stream: not a number");
      o.stream = *n;
    } else if (name == "--progress") {
      const auto n = parse_number<std::uint64_t>(value);
      if (!n) usage("--progress: not a number");
      o.progress = *n;
    } else if (name == "--peer-timeout-ms") {
      const auto n = parse_number<unsigned>(value);
      if (!n || *n == 0) usage("--peer-timeout-ms: milliseconds > 0");
      o.peer_timeout = std::chrono::milliseconds{*n};
    } else if (name == "--port") {
      const auto n = parse_number<std::uint16_t>(value);
      if (!n) usage("--port: a port number");
      o.port = *n;
    } else if (name == "--rate") {
      const auto n = parse_number<std::uint64_t>(value);
      if (!n || *n == 0) usage("--rate: messages per second > 0");
      o.rate = *n;
    } else if (name == "--session") {
      if (value != "0" && value != "1") usage("--session is 0 or 1");
      o.session = value == "1";
    } else if (name == "--session-max-delay-ms" || name == "--give-up-ms") {
      const auto n = parse_number<unsigned>(value);
      if (!n || *n == 0) usage(fmt::format("{}: milliseconds > 0", name));
      (name == "--give-up-ms" ? o.give_up : o.session_max_delay) = std::chrono::milliseconds{*n};
    } else if (name == "--timeout") {
      const auto n = parse_number<unsigned>(value);
      if (!n || *n == 0) usage("--timeout: seconds > 0");
      o.timeout = std::chrono::seconds{*n};
    } else {
      usage(fmt::format("unknown option {}", name));
    }
  }
  if (!have_backend || !have_role) usage("--backend and --role are required");
  if (o.listen.has_value() == o.connect.has_value()) usage("one of --listen and --connect");
  return o;
}

int run(const Options& o) {
  const auto deadline = Clock::now() + o.timeout;
  if (o.undumpable && ::prctl(PR_SET_DUMPABLE, 0) != 0) {
    print_line(fmt::format("END prctl(PR_SET_DUMPABLE, 0): {}", std::strerror(errno)));
    return 1;
  }
  Observer observer{o.size, print_line, o.send ? 0 : o.progress};
  netio3::test::LoopThread loop;
  std::vector<std::uint8_t> region;
  if (o.send && o.mode == SendMode::ZERO_COPY) {
    // 64 payload slots (at least one byte: a region cannot be empty).
    region.resize(std::max<std::size_t>(64 * (o.size - netio3::faults::HEADER_BYTES), 1));
  }
  auto params = netio3::faults::connection_params(o.mode, o.size, region);
  if (o.session) {
    params.delivery.session.enabled = true;
    params.delivery.session.first_delay =
        std::min(std::chrono::milliseconds{50}, o.session_max_delay);
    params.delivery.session.max_delay = o.session_max_delay;
    params.delivery.session.give_up = o.give_up;
  }
  auto config = observer.config(o.network);
  if (o.peer_timeout) config.limits.peer_timeout = *o.peer_timeout;
  config.on_connection_interrupted_cb = [](const netio3::EndPointAddress& /*remote*/,
                                           const std::string& reason) {
    print_line(
        fmt::format("INTERRUPTED at_us={} reason={}", netio3::faults::monotonic_us(), reason));
  };
  config.on_connection_resumed_cb = [](const netio3::EndPointAddress& /*remote*/,
                                       std::chrono::milliseconds outage) {
    print_line(fmt::format("RESUMED at_us={} outage_ms={}", netio3::faults::monotonic_us(),
                           outage.count()));
  };
  auto backend = netio3::Netio3Backend::create(o.backend, std::move(config), loop.loop());

  // ---- Connect
  netio3::EndPointAddress remote;
  if (o.listen) {
    const auto local = backend->open_listen_endpoint({*o.listen, o.port}, params);
    print_line(fmt::format("PORT {}", local.port));
    if (!observer.wait([](const Observer& ob) { return ob.established_count() > 0; }, deadline)) {
      print_line("END nobody connected before the deadline");
      return 3;
    }
    remote = *observer.remote(0);
  } else {
    remote = *o.connect;
    backend->open_active_endpoint(remote, params);
    const bool decided = observer.wait(
        [](const Observer& ob) { return ob.established_count() > 0 || ob.refused_count() > 0; },
        deadline);
    if (!decided || observer.refused_count() > 0) {
      print_line(decided ? "END refused" : "END not connected before the deadline");
      return decided ? 4 : 3;
    }
  }
  const auto closed = [&](const Observer& ob) {
    const ConnectionState* conn = ob.connection(remote);
    return conn != nullptr && conn->closed;
  };

  int status = 0;
  if (!o.send) {
    // ---- Receive
    const std::uint64_t want = o.messages;
    const bool ended = observer.wait(
        [&](const Observer& ob) {
          const auto* s = ob.stream(o.stream);
          return closed(ob) || (want != 0 && s != nullptr && s->received + s->bad >= want);
        },
        deadline);
    auto stream = observer.stream_copy(o.stream);
    if (want != 0 && stream.received + stream.bad >= want) {
      print_line(fmt::format("DONE received={} bad={}", stream.received, stream.bad));
      // The sender closes once it saw its completions; wait for that (and any late extra
      // message, which would be counted as bad).
      observer.wait(closed, deadline);
      stream = observer.stream_copy(o.stream);
    }
    if (!ended) status = 3;
    if (stream.bad != 0 || (want != 0 && stream.received != want)) status = 1;
    print_line(fmt::format("END received={} bad={}{}", stream.received, stream.bad,
                           ended ? "" : " (deadline)"));
  } else {
    // ---- Send
    netio3::faults::StreamSender sender{*backend, observer,
                                        netio3::faults::StreamPlan{.to = remote,
                                                                   .mode = o.mode,
                                                                   .message_size = o.size,
                                                                   .stream = o.stream,
                                                                   .count = o.messages},
                                        region};
    const std::stop_source never;
    std::uint64_t printed = 0;
    netio3::faults::StreamEnd end{};
    // Sends in slices so that progress can be printed (and the rate kept) from this thread.
    constexpr std::uint64_t PACED_SLICE = 100;
    const auto started = Clock::now();
    for (;;) {
      const std::uint64_t slice = o.rate != 0 ? PACED_SLICE : o.progress;
      const std::uint64_t slice_end =
          slice == 0 ? o.messages : sender.sent() + slice - sender.sent() % slice;
      if (o.rate != 0) {
        std::this_thread::sleep_until(
            started + std::chrono::microseconds{sender.sent() * 1'000'000 / o.rate});
      }
      end = sender.run(never.get_token(), deadline,
                       o.messages != 0 ? std::min(slice_end, o.messages) : slice_end);
      if (o.progress != 0 && sender.sent() / o.progress > printed) {
        printed = sender.sent() / o.progress;
        print_line(fmt::format("SENT {}", printed * o.progress));
      }
      if (end != netio3::faults::StreamEnd::COUNT_REACHED ||
          (o.messages != 0 && sender.sent() >= o.messages)) {
        break;
      }
    }
    if (end == netio3::faults::StreamEnd::COUNT_REACHED) {
      observer.wait(
          [&](const Observer& ob) {
            const auto* conn = ob.connection(remote);
            return conn->closed || conn->ledger.completed == o.messages;
          },
          deadline);
      const auto conn = observer.connection_copy(remote);
      if (!conn->closed && conn->ledger.completed == o.messages) {
        print_line(fmt::format("DONE sent={}", sender.sent()));
        // Everything was reported: the sender ends the connection (unless the other side
        // was quicker).
        try {
          backend->close_active_endpoint(remote);
        } catch (const netio3::UnknownActiveEndpoint&) {
        }
      }
      observer.wait(closed, deadline);
    } else if (end != netio3::faults::StreamEnd::TIMED_OUT) {
      observer.wait(closed, deadline);  // FAILED, threw or closed: the close is on its way
    }
    const auto conn = observer.connection_copy(remote);
    const auto& ledger = conn->ledger;
    print_line("LEDGER " + ledger.summary());
    if (conn->closed) {
      const auto& keys = conn->cancelled_keys;
      bool contiguous = true;
      for (std::size_t i = 1; i < keys.size(); ++i) contiguous &= keys[i] == keys[i - 1] + 1;
      print_line(fmt::format("CANCELLED count={} first={} last={} contiguous={}", keys.size(),
                             keys.empty() ? 0 : keys.front(), keys.empty() ? 0 : keys.back(),
                             contiguous ? 1 : 0));
    }
    if (!ledger.violations.empty() || (conn->closed && ledger.unreported() != 0)) status = 1;
    if (!conn->closed && Clock::now() >= deadline) status = status == 0 ? 3 : status;
    print_line(fmt::format("END {} after {} sends{}", netio3::faults::to_string(end), sender.sent(),
                           sender.error().empty() ? "" : ": " + sender.error()));
  }
  rusage usage{};
  (void)::getrusage(RUSAGE_SELF, &usage);
  print_line(fmt::format("MAXRSS kb={}", usage.ru_maxrss));
  for (const auto& violation : observer.violations_copy()) {
    print_line("VIOLATION " + violation);
    status = 1;
  }
  backend.reset();
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  try {
    return run(options);
  } catch (const std::exception& e) {
    print_line(fmt::format("END exception: {}", e.what()));
    return 1;
  }
}
