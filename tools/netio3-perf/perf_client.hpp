#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <netio3/netio3.hpp>

#include "protocol.hpp"

namespace netio3::perf {

enum class SendKind { BUFFERED, ZERO_COPY, COPY };
[[nodiscard]] std::string_view to_string(SendKind kind);
[[nodiscard]] std::optional<SendKind> parse_send_kind(std::string_view text);

struct ClientOptions {
  BackendType backend{BackendType::ASYNCMSG};
  NetworkMode mode{NetworkMode::TCP};
  SendKind send{SendKind::BUFFERED};
  Test test{Test::THROUGHPUT};
  std::size_t size{4096};  // bytes per message, netio3-perf's header included
  std::chrono::duration<double> duration{5.0};
  std::size_t connections{1};
  std::size_t threads{0};  // 0: send from the loop thread (UNSAFE backend)
  std::size_t window{0};   // buffers / zero-copy slots per connection; 0: auto
  Verify verify{Verify::LIGHT};
  std::size_t warmup{1000};  // latency: round trips left out of the statistics
  bool progress{false};      // a live line on stderr
  // EpollEventLoop::Options::busy_poll; none: what EpollEventLoop() takes from the
  // environment (NETIO3_BUSY_POLL_US).
  std::optional<std::chrono::microseconds> busy_poll;
  bool stats{false};  // RunResult::stats
  // Throughput, --threads 0: send only from on_ready_to_send_cb (and once at the start),
  // never retry on the loop's own account.
  bool on_ready{false};
  // Zero-copy: every DATA message from one buffer, written once, up to `window` of them in
  // flight - the working set of iperf3 and ucx_perftest (docs/benchmarks.md). Verify::SIZE.
  bool same_buffer{false};
  // DeliveryParameters::acknowledged on the client's connections: a send completes once the
  // server's application was handed it (docs/semantics.md).
  bool acknowledged{false};
  // DeliveryParameters::Session on the client's connections (asyncmsg; docs/sessions.md).
  bool session{false};
  // NetworkConfig::partition_key (admission, docs/admission.md); empty: none.
  std::string partition_key;
};

struct RunResult {
  bool ok{false};      // ran to the end (connections, sends and the server's reports)
  bool intact{false};  // every message arrived, in order, with the right size and content
  std::string error;   // why not, when !ok or !intact
  std::uint64_t messages{0};
  std::uint64_t bytes{0};
  double seconds{0};
  double msgs_per_s{0};
  double bytes_per_s{0};
  double cpu_ns_per_msg{0};                       // this process
  double server_cpu_ns_per_msg{0};                // the server process (from its report)
  std::optional<double> p50_us, p99_us, p999_us;  // latency: round trip
  std::size_t window{0};
  double setup_us{0};  // connection set-up (open_active_endpoint to established), mean
  std::uint64_t ready_callbacks{0};  // --on-ready: on_ready_to_send_cb calls
  // --stats: the client backend's statistics after the connections closed.
  std::optional<BackendStatistics> stats;
};

[[nodiscard]] std::shared_ptr<EpollEventLoop> make_loop(
    std::optional<std::chrono::microseconds> busy_poll);

// One run against the server at `server`: connects, runs the test for the duration,
// collects the server's reports, closes.
[[nodiscard]] RunResult run_client(const ClientOptions& options, const EndPointAddress& server);

}  // namespace netio3::perf
