// netio3-demo: a loopback send/receive demo. One process, one backend, one listen
// endpoint, one connection to it: the main thread sends messages for a few seconds, the
// event-loop thread receives them and checks that every message arrived, intact and in
// order. At the end it prints what it moved and how fast.
//
// Every message is --size bytes: an 8-byte sequence number (host byte order) followed by a
// pattern that depends on the sequence number. How it is sent (--send):
//   buffered   get_buffer / NetworkBuffer::write(seq) / write(pattern) / send_buffer;
//              64 buffers, key = buffer id
//   zero-copy  send_data: the sequence number as header_data, the pattern from a ring of 64
//              slots in one registered region (mr_start); a slot is refilled only after the
//              completion of its previous send; key = sequence number
//   copy       send_data_copy: the sequence number as header_data, the pattern from a
//              read-only table; key = sequence number
// Back-pressure: when get_buffer returns nullptr or send_* returns NO_RESOURCES, the sender
// waits (condition variable with a deadline) for on_ready_to_send_cb, which says when the
// connection takes sends again; when the ring slot it needs is still in flight, for that
// slot's completion. It never spins.
//
// Run: netio3-demo [--backend asyncmsg] [--mode tcp|rdma] [--size 4096] [--seconds 3]
//                  [--send buffered|zero-copy|copy] [--ip 127.0.0.1]
// --mode (default tcp) is NetworkConfig::mode: libfabric's tcp provider or verbs, UCX's tcp
// transport or its own choice; asyncmsg always uses TCP.
// Exit status 0 if every message sent arrived intact and in order and every send
// completed; 1 if anything was lost, corrupted or reordered (or failed); 2 for bad options.

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

enum class SendMode { BUFFERED, ZERO_COPY, COPY };

constexpr std::string_view name(SendMode mode) {
  switch (mode) {
    case SendMode::BUFFERED:
      return "buffered";
    case SendMode::ZERO_COPY:
      return "zero-copy";
    case SendMode::COPY:
      return "copy";
  }
  return "?";
}

std::optional<SendMode> parse_send_mode(std::string_view text) {
  for (const auto mode : {SendMode::BUFFERED, SendMode::ZERO_COPY, SendMode::COPY}) {
    if (text == name(mode)) return mode;
  }
  return std::nullopt;
}

constexpr std::size_t SEQUENCE_SIZE = sizeof(std::uint64_t);
constexpr std::size_t MIN_SIZE = SEQUENCE_SIZE;
constexpr std::size_t MAX_SIZE = std::size_t{16} << 20U;
// Send buffers (buffered) or ring slots (zero-copy), and receive buffers.
constexpr std::size_t IN_FLIGHT = 64;
// How long the sender waits for any progress before it declares the backend stuck.
constexpr auto STALL_TIMEOUT = 10s;
// How long the end of the run may take (everything sent must arrive and complete).
constexpr auto DRAIN_TIMEOUT = 30s;

// The payload of message `seq` is table[seq % PERIOD, seq % PERIOD + n): table[k] = k % 251,
// so a payload that belongs to another sequence number (mod 251) or is shifted, truncated
// or overwritten does not compare equal.
class Pattern {
 public:
  static constexpr std::size_t PERIOD = 251;
  explicit Pattern(std::size_t payload_size)
      : m_size{payload_size}, m_table(payload_size + PERIOD) {
    for (std::size_t k = 0; k < m_table.size(); ++k) {
      m_table[k] = static_cast<std::uint8_t>(k % PERIOD);
    }
  }
  [[nodiscard]] std::span<const std::uint8_t> payload(std::uint64_t seq) const {
    return std::span{m_table}.subspan(seq % PERIOD, m_size);
  }

 private:
  std::size_t m_size;
  std::vector<std::uint8_t> m_table;
};

// Everything the callbacks (loop thread) and the sender (main thread) share.
struct State {
  std::mutex mutex;
  std::condition_variable cv;
  // connection
  int established = 0;
  int closed = 0;
  bool refused = false;
  // send side
  std::uint64_t completed = 0;
  std::uint64_t ready = 0;  // on_ready_to_send_cb calls
  std::vector<std::uint64_t> cancelled;
  std::vector<bool> slot_busy = std::vector<bool>(IN_FLIGHT);  // zero-copy ring
  // receive side
  std::uint64_t received = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t expected_seq = 0;
  std::uint64_t errors = 0;
  std::string first_error;
  Clock::time_point last_receive{};
};

struct Totals {
  std::uint64_t sent = 0;
  std::uint64_t no_resources = 0;      // NO_RESOURCES answers (each followed by a wait)
  std::uint64_t waits_for_buffer = 0;  // get_buffer returned nullptr / ring slot in flight
};

class Demo {
 public:
  Demo(BackendType backend_type, NetworkMode network, std::string ip, std::size_t size,
       SendMode mode)
      : m_ip{std::move(ip)},
        m_size{size},
        m_mode{mode},
        m_pattern{size - SEQUENCE_SIZE},
        m_ring(mode == SendMode::ZERO_COPY
                   ? std::max<std::size_t>(1, IN_FLIGHT * (size - SEQUENCE_SIZE))
                   : 0) {
    m_backend = Netio3Backend::create(
        backend_type,
        {
            .mode = network,
            .thread_safety = ThreadSafetyModel::SAFE,
            .on_data_cb = [this](std::span<const std::uint8_t> data) { on_data(data); },
            .on_connection_established_cb =
                [this](const EndPointAddress&, EndpointCapabilities) {
                  update([&] { ++m_state.established; });
                },
            .on_connection_closed_cb =
                [this](const EndPointAddress&, const std::vector<std::uint64_t>& keys) {
                  update([&] {
                    ++m_state.closed;
                    m_state.cancelled.insert(m_state.cancelled.end(), keys.begin(), keys.end());
                  });
                },
            .on_connection_refused_cb =
                [this](const EndPointAddress&) { update([&] { m_state.refused = true; }); },
            .on_send_completed_cb =
                [this](const EndPointAddress&, std::uint64_t key) {
                  update([&] {
                    ++m_state.completed;
                    if (m_mode == SendMode::ZERO_COPY) m_state.slot_busy[key % IN_FLIGHT] = false;
                  });
                },
            .on_ready_to_send_cb =
                [this](const EndPointAddress&) { update([&] { ++m_state.ready; }); },
        },
        m_loop);
    m_thread = std::jthread([loop = m_loop] { loop->run(); });
  }

  Demo(const Demo&) = delete;
  Demo& operator=(const Demo&) = delete;
  Demo(Demo&&) = delete;
  Demo& operator=(Demo&&) = delete;

  ~Demo() {
    m_loop->stop();
    if (m_thread.joinable()) m_thread.join();
    m_backend.reset();  // the loop no longer runs: closes inline, without callbacks
  }

  // Listens on port 0, connects to it and waits until both sides are established.
  void connect() {
    m_listen = m_backend->open_listen_endpoint(
        {m_ip, 0}, {.recv_params{.buf_size = m_size, .num_buf = IN_FLIGHT}});
    m_remote = m_listen;
    ConnectionParameters params{};
    switch (m_mode) {
      case SendMode::BUFFERED:
        params.send_buffered_params = {.buf_size = m_size, .num_buf = IN_FLIGHT};
        break;
      case SendMode::ZERO_COPY:
        params.send_zero_copy_params = {.buf_size = m_ring.size(), .mr_start = m_ring.data()};
        break;
      case SendMode::COPY:
        break;
    }
    m_backend->open_active_endpoint(m_remote, params);
    std::unique_lock lock{m_state.mutex};
    if (!m_state.cv.wait_for(
            lock, STALL_TIMEOUT,
            [&] { return m_state.established == 2 || m_state.refused || m_state.closed > 0; }) ||
        m_state.established != 2) {
      throw std::runtime_error(fmt::format("the connection to {} was not established ({})",
                                           m_remote, m_state.refused ? "refused" : "timed out"));
    }
  }

  // Sends until `duration` has passed; throws if the backend fails or stalls.
  Totals send_for(std::chrono::duration<double> duration) {
    m_start = Clock::now();
    const auto stop = m_start + std::chrono::duration_cast<Clock::duration>(duration);
    Totals totals;
    for (std::uint64_t seq = 0; Clock::now() < stop; ++seq) {
      send_one(seq, totals);
      ++totals.sent;
    }
    return totals;
  }

  // Waits until everything sent arrived and completed (or the deadline passed).
  bool drain(std::uint64_t sent) {
    std::unique_lock lock{m_state.mutex};
    return m_state.cv.wait_for(lock, DRAIN_TIMEOUT, [&] {
      return (m_state.received >= sent || m_state.closed > 0) &&
             m_state.completed + m_state.cancelled.size() >= sent;
    });
  }

  // Closes the connection (both of its sides report on_connection_closed_cb) and the
  // listener.
  bool close() {
    m_backend->close_active_endpoint(m_remote);
    bool both_closed = false;
    {
      std::unique_lock lock{m_state.mutex};
      both_closed = m_state.cv.wait_for(lock, STALL_TIMEOUT, [&] { return m_state.closed == 2; });
    }
    m_backend->close_listen_endpoint(m_listen);
    return both_closed;
  }

  [[nodiscard]] const EndPointAddress& listen_address() const { return m_listen; }
  [[nodiscard]] Clock::time_point start() const { return m_start; }
  State& state() { return m_state; }

 private:
  template <typename F>
  void update(F&& change) {
    {
      const std::lock_guard lock{m_state.mutex};
      change();
    }
    m_state.cv.notify_all();
  }

  // on_ready_to_send_cb calls so far: read before a send, so that a callback after its
  // refusal is never missed.
  [[nodiscard]] std::uint64_t ready_calls() {
    const std::lock_guard lock{m_state.mutex};
    return m_state.ready;
  }

  // Waits until on_ready_to_send_cb came after the `seen` calls before; throws after
  // STALL_TIMEOUT.
  void wait_until_ready(std::uint64_t seen, std::string_view why) {
    std::unique_lock lock{m_state.mutex};
    if (!m_state.cv.wait_for(lock, STALL_TIMEOUT,
                             [&] { return m_state.ready > seen || m_state.closed > 0; }) ||
        m_state.closed > 0) {
      throw std::runtime_error(fmt::format(
          "{}, and no on_ready_to_send_cb within {} s ({} completed so far, connection {})", why,
          std::chrono::duration_cast<std::chrono::seconds>(STALL_TIMEOUT).count(),
          m_state.completed, m_state.closed > 0 ? "closed" : "open"));
    }
  }

  void send_one(std::uint64_t seq, Totals& totals) {
    const auto payload = m_pattern.payload(seq);
    std::array<std::uint8_t, SEQUENCE_SIZE> header{};
    std::memcpy(header.data(), &seq, SEQUENCE_SIZE);
    switch (m_mode) {
      case SendMode::BUFFERED:
        send_buffered(seq, payload, totals);
        return;
      case SendMode::ZERO_COPY: {
        const std::size_t slot = seq % IN_FLIGHT;
        {
          std::unique_lock lock{m_state.mutex};
          if (m_state.slot_busy[slot]) {
            ++totals.waits_for_buffer;
            if (!m_state.cv.wait_for(lock, STALL_TIMEOUT,
                                     [&] { return !m_state.slot_busy[slot]; })) {
              throw std::runtime_error(fmt::format(
                  "zero-copy slot {} still in flight after {} s", slot,
                  std::chrono::duration_cast<std::chrono::seconds>(STALL_TIMEOUT).count()));
            }
          }
          m_state.slot_busy[slot] = true;
        }
        const auto memory = std::span{m_ring}.subspan(slot * payload.size(), payload.size());
        std::copy(payload.begin(), payload.end(), memory.begin());
        retry_send(totals, [&] { return m_backend->send_data(m_remote, memory, header, seq); });
        return;
      }
      case SendMode::COPY:
        retry_send(totals,
                   [&] { return m_backend->send_data_copy(m_remote, payload, header, seq); });
        return;
    }
  }

  void send_buffered(std::uint64_t seq, std::span<const std::uint8_t> payload, Totals& totals) {
    NetworkBuffer* buffer = nullptr;
    while (buffer == nullptr) {
      const auto seen = ready_calls();
      buffer = m_backend->get_buffer(m_remote);
      if (buffer == nullptr) {
        ++totals.waits_for_buffer;
        wait_until_ready(seen, "get_buffer returned nullptr");
      }
    }
    buffer->write(seq);
    buffer->write(payload);
    retry_send(totals, [&] { return m_backend->send_buffer(m_remote, buffer); });
  }

  // Calls send() until it returns OK; NO_RESOURCES waits for on_ready_to_send_cb first.
  template <typename Send>
  void retry_send(Totals& totals, Send&& send) {
    for (;;) {
      const auto seen = ready_calls();
      switch (send()) {
        case NetioStatus::OK:
          return;
        case NetioStatus::NO_RESOURCES:
          ++totals.no_resources;
          wait_until_ready(seen, "the backend answered NO_RESOURCES");
          break;
        case NetioStatus::FAILED:
          throw std::runtime_error(fmt::format("a {} send returned FAILED", name(m_mode)));
      }
    }
  }

  // Loop thread. Checks size, order and content of every message.
  void on_data(std::span<const std::uint8_t> data) {
    const auto now = Clock::now();
    std::string error;
    std::uint64_t seq = 0;
    if (data.size() != m_size) {
      error = fmt::format("a message of {} bytes arrived, expected {}", data.size(), m_size);
    } else {
      std::memcpy(&seq, data.data(), SEQUENCE_SIZE);
    }
    {
      const std::lock_guard lock{m_state.mutex};
      if (error.empty()) {
        const auto payload = data.subspan(SEQUENCE_SIZE);
        if (seq != m_state.expected_seq) {
          error =
              fmt::format("message {} arrived when {} was expected ({})", seq, m_state.expected_seq,
                          seq > m_state.expected_seq ? "lost" : "reordered or duplicated");
        } else if (!std::equal(payload.begin(), payload.end(), m_pattern.payload(seq).begin())) {
          error = fmt::format("message {} is corrupted", seq);
        }
        m_state.expected_seq = seq + 1;
      }
      if (!error.empty()) {
        if (m_state.errors == 0) m_state.first_error = error;
        ++m_state.errors;
      }
      ++m_state.received;
      m_state.bytes_received += data.size();
      m_state.last_receive = now;
    }
    m_state.cv.notify_all();
  }

  std::string m_ip;
  std::size_t m_size;
  SendMode m_mode;
  Pattern m_pattern;
  std::vector<std::uint8_t> m_ring;  // zero-copy: IN_FLIGHT payload slots
  State m_state;
  std::shared_ptr<EpollEventLoop> m_loop = std::make_shared<EpollEventLoop>();
  std::unique_ptr<NetworkBackend> m_backend;
  std::jthread m_thread;
  EndPointAddress m_listen;
  EndPointAddress m_remote;
  Clock::time_point m_start{};
};

}  // namespace

int main(int argc, char** argv) {
  std::cout.setf(std::ios::unitbuf);  // line by line, also into a pipe
  const auto options = example::Options::parse(
      argc, argv,
      {{"size", "4096"}, {"seconds", "3"}, {"send", "copy"}, {"ip", "127.0.0.1"}, {"mode", "tcp"}});
  if (!options) return 2;
  const auto backend_type = options->backend();
  const auto size = options->number<std::size_t>("size");
  const auto seconds = options->number<double>("seconds");
  const auto mode = parse_send_mode(options->str("send"));
  if (!mode)
    std::cerr << fmt::format("--send: '{}' is not buffered, zero-copy or copy\n",
                             options->str("send"));
  const auto network = parse_network_mode(options->str("mode"));
  if (!network) std::cerr << fmt::format("--mode: '{}' is not tcp or rdma\n", options->str("mode"));
  if (!backend_type || !size || !seconds || !mode || !network) return 2;
  if (*size < MIN_SIZE || *size > MAX_SIZE) {
    std::cerr << fmt::format("--size: {} is outside [{}, {}]\n", *size, MIN_SIZE, MAX_SIZE);
    return 2;
  }
  if (!(*seconds > 0.0 && *seconds <= 3600.0)) {
    std::cerr << fmt::format("--seconds: {} is outside (0, 3600]\n", *seconds);
    return 2;
  }

  try {
    Demo demo{*backend_type, *network, options->str("ip"), *size, *mode};
    demo.connect();
    std::cout << fmt::format(
        "netio3-demo: {} backend, loopback via {}, {} sends of {}-byte messages for {} s\n",
        *backend_type, demo.listen_address(), name(*mode), *size, *seconds);

    const Totals totals = demo.send_for(std::chrono::duration<double>{*seconds});
    const bool drained = demo.drain(totals.sent);
    const bool closed = demo.close();

    State& s = demo.state();
    const std::lock_guard lock{s.mutex};
    const double elapsed =
        std::chrono::duration<double>(std::max(s.last_receive, demo.start()) - demo.start())
            .count();
    const double per_second = elapsed > 0 ? 1.0 / elapsed : 0.0;
    const auto bytes = static_cast<double>(s.bytes_received);
    std::cout << fmt::format(
        "sent:     {} messages ({} x NO_RESOURCES, {} x waited for a free {})\n", totals.sent,
        totals.no_resources, totals.waits_for_buffer,
        *mode == SendMode::ZERO_COPY ? "ring slot" : "buffer");
    std::cout << fmt::format("received: {} messages, {} bytes in {:.3f} s\n", s.received,
                             s.bytes_received, elapsed);
    std::cout << fmt::format("rate:     {:.1f} MB/s, {:.3f} Gbit/s, {:.0f} msg/s\n",
                             bytes * per_second / 1e6, bytes * 8 * per_second / 1e9,
                             static_cast<double>(s.received) * per_second);

    std::vector<std::string> problems;
    if (!drained) problems.push_back("timed out waiting for the last messages and completions");
    if (s.errors > 0) {
      problems.push_back(fmt::format("{} bad message(s), the first: {}", s.errors, s.first_error));
    }
    if (s.received != totals.sent) {
      problems.push_back(fmt::format("{} message(s) sent, {} received", totals.sent, s.received));
    }
    if (s.completed != totals.sent) {
      problems.push_back(
          fmt::format("{} send(s) accepted, {} completed", totals.sent, s.completed));
    }
    if (!s.cancelled.empty()) {
      problems.push_back(fmt::format("{} send(s) cancelled", s.cancelled.size()));
    }
    if (!closed) problems.push_back("on_connection_closed_cb did not come for both sides");
    if (totals.sent == 0) problems.push_back("nothing was sent");
    if (problems.empty()) {
      std::cout << "result:   OK, every message arrived intact and in order\n";
      return 0;
    }
    for (const auto& problem : problems) std::cout << fmt::format("FAILED:   {}\n", problem);
    return 1;
  } catch (const std::exception& e) {
    std::cout << fmt::format("FAILED:   {}\n", e.what());
    return 1;
  }
}
