// Integrity under load (label `reliability`): for every backend compiled in, two backends
// on their own loops connected by several connections carry checked traffic in both
// directions at once, from several sender threads (SAFE) or from the loop thread through a
// signal (UNSAFE), in every send mode the backend supports, with sizes from 0 B to 16 KiB.
//
// Checked on every message: it is the next one of its stream (exactly once, in order), of
// the right size, with the right checksum and content. Checked on every key: each send that
// returned OK ends exactly once, in on_send_completed_cb or in the closed callback's
// cancelled keys, and no completion follows the closed callback.
//
// NETIO3_RELIABILITY_MESSAGES sets the number of messages per test (both directions
// together); the default is 1,000,000, the sanitizer presets set fewer (tests/CMakeLists).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "test_support.hpp"
#include "traffic.hpp"

namespace netio3::reliability {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

enum class SendMode { BUFFERED, ZERO_COPY, COPY };

constexpr std::size_t MAX_SIZE = std::size_t{16} << 10U;  // largest message
constexpr std::size_t CONNECTIONS = 3;
constexpr std::size_t SLOTS = 64;  // zero-copy slots per connection
constexpr std::uint32_t NO_SLOT = 0xFFFF;
constexpr auto RUN_DEADLINE = 240s;

std::uint64_t messages_per_test() {
  const char* env = std::getenv("NETIO3_RELIABILITY_MESSAGES");
  if (env != nullptr && *env != '\0') return std::strtoull(env, nullptr, 10);
  return 1'000'000;
}

// What both sides share: one lock and condition for everything a waiter may wait on, and
// the errors found on any thread.
struct Sync {
  std::mutex mutex;
  std::condition_variable cv;
  std::uint64_t progress{0};
  std::vector<std::string> errors;
  bool stop{false};

  void bump() {
    {
      const std::lock_guard lock{mutex};
      ++progress;
    }
    cv.notify_all();
  }
  void fail(std::string what) {
    {
      const std::lock_guard lock{mutex};
      if (errors.size() < 10) errors.push_back(std::move(what));
      stop = true;
    }
    cv.notify_all();
  }
  template <typename Pred>
  bool wait(Pred pred, Clock::time_point deadline) {
    std::unique_lock lock{mutex};
    return cv.wait_until(lock, deadline, [&] { return pred() || !errors.empty(); }) &&
           errors.empty();
  }
};

// A connection as its sending side sees it.
struct Conn {
  EndPointAddress to;
  std::vector<SendMode> modes;
  KeyLedger ledger;
  std::atomic<std::uint64_t> next_key{0};
  std::vector<std::uint8_t> region;  // zero-copy slots
  std::mutex slot_mutex;
  std::vector<std::uint32_t> free_slots;
  // A NetworkBuffer* lives until the connection's closed callback: a buffered send holds
  // this in shared mode from get_buffer to send_buffer (and while it keeps a buffer for a
  // retry), the closed callback takes it exclusively and marks the connection closed.
  std::shared_mutex buffers_mutex;
  bool closed{false};  // under buffers_mutex

  void init_region() {
    region.assign(SLOTS * MAX_SIZE, 0);
    for (std::uint32_t i = 0; i < SLOTS; ++i) free_slots.push_back(i);
  }
  void release(std::uint64_t key) {
    if (key < DATA_KEY_BASE || (key & 0xFFFFU) == NO_SLOT) return;
    const std::lock_guard lock{slot_mutex};
    free_slots.push_back(static_cast<std::uint32_t>(key & 0xFFFFU));
  }
};

struct Stream {
  std::uint32_t id{};
  Conn* conn{};
  bool tiny{};
  std::uint64_t total{};
  std::uint64_t next{0};
  NetworkBuffer* pending{nullptr};  // written for message `next`, not accepted yet
  bool done{false};
};

enum class Attempt { SENT, NO_RESOURCES, GONE };

// One backend on its own loop.
class Side {
 public:
  Side(BackendType type, ThreadSafetyModel model, Sync& sync) : m_model{model}, m_sync{sync} {
    NetworkConfig config{.mode = test::mode_for(type), .thread_safety = model};
    config.on_data_cb = [this](std::span<const std::uint8_t> data) { on_data(data); };
    config.on_connection_established_cb = [this](const EndPointAddress& remote,
                                                 EndpointCapabilities) {
      {
        const std::lock_guard lock{m_sync.mutex};
        m_established.push_back(remote);
      }
      m_sync.bump();
    };
    config.on_connection_refused_cb = [this](const EndPointAddress& remote) {
      m_sync.fail(fmt::format("connection to {} refused", remote));
    };
    config.on_send_completed_cb = [this](const EndPointAddress& remote, std::uint64_t key) {
      Conn* conn = find(remote);
      if (conn == nullptr) {
        m_sync.fail(fmt::format("completion of key {} for unknown {}", key, remote));
        return;
      }
      conn->ledger.completed(key);
      conn->release(key);
      after_progress();
    };
    config.on_connection_closed_cb = [this](const EndPointAddress& remote,
                                            const std::vector<std::uint64_t>& keys) {
      if (Conn* conn = find(remote)) {
        {
          const std::unique_lock lock{conn->buffers_mutex};
          conn->closed = true;
        }
        conn->ledger.closed(keys);
        for (const std::uint64_t key : keys) conn->release(key);
      }
      {
        const std::lock_guard lock{m_sync.mutex};
        ++m_closed;
      }
      after_progress();
    };
    backend = Netio3Backend::create(type, std::move(config), m_loop.loop());
    if (model == ThreadSafetyModel::UNSAFE) {
      m_pump = m_loop.loop()->create_signal([this] { pump(); });
    }
  }
  ~Side() {
    m_loop.loop()->run_sync([this] { m_pump.close(); });
    backend.reset();
  }
  Side(const Side&) = delete;
  Side& operator=(const Side&) = delete;
  Side(Side&&) = delete;
  Side& operator=(Side&&) = delete;

  template <typename F>
  void call(F&& f) {
    if (m_model == ThreadSafetyModel::SAFE) {
      f();
    } else {
      m_loop.loop()->run_sync(std::forward<F>(f));
    }
  }

  void expect_streams(std::unique_ptr<StreamChecker> checker, std::uint64_t notify_at) {
    m_checker = std::move(checker);
    m_notify_at = notify_at;
  }
  [[nodiscard]] const StreamChecker& checker() const { return *m_checker; }

  Conn& add_conn(EndPointAddress to, std::vector<SendMode> modes) {
    auto conn = std::make_unique<Conn>();
    conn->to = std::move(to);
    conn->modes = std::move(modes);
    if (std::find(conn->modes.begin(), conn->modes.end(), SendMode::ZERO_COPY) !=
        conn->modes.end()) {
      conn->init_region();
    }
    const std::lock_guard lock{m_sync.mutex};
    m_by_remote[conn->to] = conn.get();
    return *m_conns.emplace_back(std::move(conn));
  }
  [[nodiscard]] std::vector<std::unique_ptr<Conn>>& conns() { return m_conns; }

  // Under m_sync.mutex.
  [[nodiscard]] const std::vector<EndPointAddress>& established() const { return m_established; }
  [[nodiscard]] std::size_t closed() const { return m_closed; }

  void add_stream(Stream stream) { m_streams.push_back(stream); }
  [[nodiscard]] std::vector<Stream>& streams() { return m_streams; }

  // Sends the streams: one thread per stream (SAFE), or the loop thread driven by a signal
  // that every completion fires (UNSAFE).
  void start() {
    if (m_model == ThreadSafetyModel::UNSAFE) {
      m_pump.fire();
      return;
    }
    for (Stream& stream : m_streams) {
      m_threads.emplace_back([this, &stream] { send_all(stream); });
    }
  }
  void join() { m_threads.clear(); }

  [[nodiscard]] bool all_sent() {
    if (m_model == ThreadSafetyModel::SAFE) {
      return std::all_of(m_streams.begin(), m_streams.end(),
                         [](const Stream& s) { return s.next == s.total; });
    }
    bool sent = false;
    m_loop.loop()->run_sync([&] {
      sent = std::all_of(m_streams.begin(), m_streams.end(),
                         [](const Stream& s) { return s.next == s.total; });
    });
    return sent;
  }

  std::unique_ptr<NetworkBackend> backend;
  // Set when the test closes connections while traffic runs: failed sends are expected.
  std::atomic<bool> closing_expected{false};

 private:
  Conn* find(const EndPointAddress& remote) {
    const std::lock_guard lock{m_sync.mutex};
    auto it = m_by_remote.find(remote);
    return it == m_by_remote.end() ? nullptr : it->second;
  }

  void after_progress() {
    if (m_model == ThreadSafetyModel::UNSAFE) m_pump.fire();
    m_sync.bump();
  }

  void on_data(std::span<const std::uint8_t> data) {
    if (!m_checker) {
      m_sync.fail("data before the streams were set up");
      return;
    }
    if (auto error = m_checker->verify(data)) {
      m_sync.fail(std::move(*error));
      return;
    }
    if (m_checker->received_total() == m_notify_at) m_sync.bump();
  }

  Attempt attempt(Stream& s) {
    Conn& c = *s.conn;
    const std::uint64_t h = mix((std::uint64_t{s.id} << 32U) ^ s.next ^ 0x5A5AU);
    const std::size_t size = message_size(s.id, s.next, s.tiny, MAX_SIZE);
    const SendMode mode = s.pending != nullptr ? SendMode::BUFFERED : c.modes[h % c.modes.size()];
    const std::size_t header_len = std::min<std::size_t>(size, (h >> 8U) % (MAX_HEADER_SIZE + 1));
    const bool use_iov = ((h >> 16U) & 3U) == 0 && size - header_len >= 2;
    NetioStatus status = NetioStatus::FAILED;
    std::optional<std::uint64_t> expected;  // the key of a send call in progress
    // Every mode, not only buffered: once the closed callback ran (it takes this lock
    // exclusively) no send starts, so when the test checks the ledgers after the last
    // closed callback no attempt sits between expect() and withdraw().
    const std::shared_lock closed_guard{c.buffers_mutex};
    if (c.closed) {
      s.pending = nullptr;  // a held buffer went with its connection
      return Attempt::GONE;
    }
    try {
      switch (mode) {
        case SendMode::BUFFERED: {
          NetworkBuffer* buffer = s.pending;
          if (buffer == nullptr) {
            buffer = backend->get_buffer(c.to);
            if (buffer == nullptr) return Attempt::NO_RESOURCES;
            buffer->resize(size);
            write_message(std::span<std::uint8_t>{buffer->data(), size}, s.id, s.next);
          }
          expected = buffer->id();
          c.ledger.expect(*expected);
          status = backend->send_buffer(c.to, buffer);
          if (status != NetioStatus::OK) c.ledger.withdraw(buffer->id());
          s.pending = status == NetioStatus::NO_RESOURCES ? buffer : nullptr;
          break;
        }
        case SendMode::ZERO_COPY: {
          std::uint32_t slot = 0;
          {
            const std::lock_guard lock{c.slot_mutex};
            if (c.free_slots.empty()) return Attempt::NO_RESOURCES;
            slot = c.free_slots.back();
            c.free_slots.pop_back();
          }
          const std::uint64_t key = DATA_KEY_BASE + (c.next_key++ << 16U) + slot;
          std::uint8_t* at = c.region.data() + std::size_t{slot} * MAX_SIZE;
          write_message(std::span<std::uint8_t>{at, size}, s.id, s.next);
          const std::span<const std::uint8_t> header{at, header_len};
          expected = key;
          c.ledger.expect(key);
          if (use_iov) {
            const std::size_t first = (size - header_len) / 2;
            const std::array<iovec, 2> iov{
                iovec{at + header_len, first},
                iovec{at + header_len + first, size - header_len - first}};
            status = backend->send_data(c.to, iov, header, key);
          } else {
            status = backend->send_data(
                c.to, std::span<std::uint8_t>{at + header_len, size - header_len}, header, key);
          }
          if (status != NetioStatus::OK) {
            c.ledger.withdraw(key);
            c.release(key);
          }
          break;
        }
        case SendMode::COPY: {
          thread_local std::vector<std::uint8_t> scratch(MAX_SIZE);
          write_message(std::span<std::uint8_t>{scratch.data(), size}, s.id, s.next);
          const std::uint64_t key = DATA_KEY_BASE + (c.next_key++ << 16U) + NO_SLOT;
          const std::span<const std::uint8_t> header{scratch.data(), header_len};
          expected = key;
          c.ledger.expect(key);
          if (use_iov) {
            const std::size_t first = (size - header_len) / 2;
            const std::array<iovec, 2> iov{
                iovec{scratch.data() + header_len, first},
                iovec{scratch.data() + header_len + first, size - header_len - first}};
            status = backend->send_data_copy(c.to, iov, header, key);
          } else {
            status = backend->send_data_copy(
                c.to, std::span<const std::uint8_t>{scratch}.subspan(header_len, size - header_len),
                header, key);
          }
          if (status != NetioStatus::OK) c.ledger.withdraw(key);
          break;
        }
      }
    } catch (const UnknownActiveEndpoint&) {
      // Closed (by the test, or by the peer's close) before or during the call.
      if (expected) {
        c.ledger.withdraw(*expected);
        c.release(*expected);
      }
      return Attempt::GONE;
    }
    switch (status) {
      case NetioStatus::OK:
        ++s.next;
        return Attempt::SENT;
      case NetioStatus::NO_RESOURCES:
        return Attempt::NO_RESOURCES;
      case NetioStatus::FAILED:
        break;
    }
    return Attempt::GONE;  // FAILED: the connection is closing
  }

  void gone(Stream& s) {
    s.done = true;
    bool stopping = false;
    {
      const std::lock_guard lock{m_sync.mutex};
      stopping = m_sync.stop;
    }
    if (!stopping && !s.conn->ledger.is_closed() && !closing_expected) {
      m_sync.fail(
          fmt::format("stream {}: send of message {} failed on an open connection", s.id, s.next));
    }
  }

  void send_all(Stream& s) {
    const auto deadline = Clock::now() + RUN_DEADLINE;
    while (s.next < s.total) {
      std::uint64_t seen = 0;
      {
        const std::lock_guard lock{m_sync.mutex};
        if (m_sync.stop) return;
        seen = m_sync.progress;
      }
      const Attempt a = attempt(s);
      if (a == Attempt::SENT) continue;
      if (a == Attempt::GONE) return gone(s);
      std::unique_lock lock{m_sync.mutex};
      if (!m_sync.cv.wait_until(lock, deadline,
                                [&] { return m_sync.progress != seen || m_sync.stop; })) {
        lock.unlock();
        m_sync.fail(
            fmt::format("stream {}: NO_RESOURCES and no progress until the deadline", s.id));
        return;
      }
    }
  }

  void pump() {
    for (Stream& s : m_streams) {
      while (!s.done && s.next < s.total) {
        const Attempt a = attempt(s);
        if (a == Attempt::SENT) continue;
        if (a == Attempt::GONE) gone(s);
        break;
      }
    }
  }

  ThreadSafetyModel m_model;
  Sync& m_sync;
  test::LoopThread m_loop;
  EventSignalHandle m_pump;
  std::unique_ptr<StreamChecker> m_checker;
  std::uint64_t m_notify_at{0};
  std::vector<std::unique_ptr<Conn>> m_conns;
  std::map<EndPointAddress, Conn*> m_by_remote;
  std::vector<EndPointAddress> m_established;
  std::size_t m_closed{0};
  std::vector<Stream> m_streams;
  std::vector<std::jthread> m_threads;
};

using Param = std::tuple<BackendType, ThreadSafetyModel>;

class Integrity : public ::testing::TestWithParam<Param> {
 protected:
  [[nodiscard]] BackendType type() const { return std::get<0>(GetParam()); }
  [[nodiscard]] ThreadSafetyModel model() const { return std::get<1>(GetParam()); }

  // Modes the active side (a) uses on connection i, and the passive side (b) on all.
  [[nodiscard]] std::vector<SendMode> active_modes(std::size_t i) const {
    if (type() == BackendType::LIBFABRIC) {
      // No copy sends; buffered and zero-copy exclude each other on one endpoint.
      return {i % 2 == 1 ? SendMode::ZERO_COPY : SendMode::BUFFERED};
    }
    return {SendMode::BUFFERED, SendMode::ZERO_COPY, SendMode::COPY};
  }
  [[nodiscard]] std::vector<SendMode> passive_modes() const {
    if (type() == BackendType::LIBFABRIC) return {SendMode::BUFFERED};
    return {SendMode::BUFFERED, SendMode::COPY};
  }

  // Connects a to b over CONNECTIONS connections, sets up the streams of both directions
  // (`total` messages in all) and the checkers. Fails the test if the
  // connections do not come up. Each receiver's waiters are woken when it has received
  // `notify_at` messages (0: all of them).
  void connect(std::uint64_t total, std::uint64_t notify_at) {
    const std::size_t per_conn = model() == ThreadSafetyModel::SAFE ? 2 : 1;
    const std::size_t streams_per_side = CONNECTIONS * per_conn;
    const std::uint64_t per_stream = std::max<std::uint64_t>(total / (2 * streams_per_side), 1);
    if (notify_at == 0) notify_at = per_stream * streams_per_side;

    std::vector<StreamChecker::Expect> expects(streams_per_side, {false, MAX_SIZE});
    expects[0].tiny = true;
    m_b->expect_streams(std::make_unique<StreamChecker>(0, expects), notify_at);
    m_a->expect_streams(
        std::make_unique<StreamChecker>(static_cast<std::uint32_t>(streams_per_side), expects),
        notify_at);

    const ConnectionParameters listen_params{
        .recv_params = {.buf_size = MAX_SIZE, .num_buf = 64},
        .send_buffered_params = {.buf_size = MAX_SIZE, .num_buf = 32}};
    std::vector<EndPointAddress> listeners;
    m_b->call([&] {
      for (std::size_t i = 0; i < CONNECTIONS; ++i) {
        listeners.push_back(
            m_b->backend->open_listen_endpoint({test::test_address(), 0}, listen_params));
      }
    });
    for (std::size_t i = 0; i < CONNECTIONS; ++i) {
      Conn& conn = m_a->add_conn(listeners[i], active_modes(i));
      ConnectionParameters params{.recv_params = {.buf_size = MAX_SIZE, .num_buf = 64}};
      for (const SendMode mode : conn.modes) {
        if (mode == SendMode::BUFFERED) params.send_buffered_params = {MAX_SIZE, 32};
        if (mode == SendMode::ZERO_COPY) {
          params.send_zero_copy_params = {conn.region.size(), conn.region.data()};
        }
      }
      m_a->call([&] { m_a->backend->open_active_endpoint(conn.to, params); });
    }
    ASSERT_TRUE(m_sync.wait(
        [&] {
          return m_a->established().size() == CONNECTIONS &&
                 m_b->established().size() == CONNECTIONS;
        },
        Clock::now() + test::DEFAULT_TIMEOUT))
        << errors();
    std::vector<EndPointAddress> accepted;
    {
      const std::lock_guard lock{m_sync.mutex};
      accepted = m_b->established();
    }
    for (const auto& remote : accepted) m_b->add_conn(remote, passive_modes());

    std::uint32_t id = 0;
    for (Side* side : {m_a.get(), m_b.get()}) {
      for (auto& conn : side->conns()) {
        for (std::size_t t = 0; t < per_conn; ++t, ++id) {
          side->add_stream(Stream{.id = id,
                                  .conn = conn.get(),
                                  .tiny = id % streams_per_side == 0,
                                  .total = per_stream});
        }
      }
    }
    m_per_stream = per_stream;
    m_streams_per_side = streams_per_side;
  }

  [[nodiscard]] std::string errors() {
    const std::lock_guard lock{m_sync.mutex};
    std::string all;
    for (const auto& e : m_sync.errors) all += e + "\n";
    return all;
  }

  // Closes every connection from the active side and waits for both closed callbacks.
  void close_all() {
    m_a->call([&] {
      for (auto& conn : m_a->conns()) m_a->backend->close_active_endpoint(conn->to);
    });
    EXPECT_TRUE(
        m_sync.wait([&] { return m_a->closed() == CONNECTIONS && m_b->closed() == CONNECTIONS; },
                    Clock::now() + test::DEFAULT_TIMEOUT))
        << "closed callbacks: " << m_a->closed() << " / " << m_b->closed() << "\n"
        << errors();
  }

  // Every accepted send ended exactly once; returns (accepted, completed, cancelled).
  std::tuple<std::uint64_t, std::uint64_t, std::uint64_t> check_ledgers() {
    std::uint64_t accepted = 0;
    std::uint64_t completed = 0;
    std::uint64_t cancelled = 0;
    for (Side* side : {m_a.get(), m_b.get()}) {
      for (auto& conn : side->conns()) {
        for (const auto& e : conn->ledger.errors()) ADD_FAILURE() << conn->to << ": " << e;
        EXPECT_EQ(conn->ledger.outstanding(), 0U)
            << conn->to << ": accepted sends that never ended";
        EXPECT_EQ(conn->ledger.accepted(),
                  conn->ledger.completed_count() + conn->ledger.cancelled_count())
            << conn->to;
        accepted += conn->ledger.accepted();
        completed += conn->ledger.completed_count();
        cancelled += conn->ledger.cancelled_count();
      }
    }
    return {accepted, completed, cancelled};
  }

  void SetUp() override {
    // Keep the default output, and remember warnings: a connection closed for a protocol
    // error means a stream lost its framing, which no test here may cause.
    set_log_sink([this](LogLevel level, std::string_view line) {
      std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
      if (level < LogLevel::warn) return;
      const std::lock_guard lock{m_log_mutex};
      m_warnings.emplace_back(line);
    });
  }

  // Warnings that say a connection was closed for malformed input.
  [[nodiscard]] std::vector<std::string> protocol_errors() {
    static constexpr std::array<std::string_view, 6> WORDS{"frame",    "protocol",  "header",
                                                           "sequence", "malformed", "magic"};
    const std::lock_guard lock{m_log_mutex};
    std::vector<std::string> found;
    for (const auto& line : m_warnings) {
      if (std::any_of(WORDS.begin(), WORDS.end(),
                      [&](std::string_view w) { return line.find(w) != std::string::npos; })) {
        found.push_back(line);
      }
    }
    return found;
  }

  void TearDown() override {
    {
      const std::lock_guard lock{m_sync.mutex};
      m_sync.stop = true;
    }
    m_sync.cv.notify_all();
    if (m_a) m_a->join();
    if (m_b) m_b->join();
    m_a.reset();
    m_b.reset();
    set_log_sink(nullptr);
  }

  Sync m_sync;
  std::unique_ptr<Side> m_a = std::make_unique<Side>(type(), model(), m_sync);
  std::unique_ptr<Side> m_b = std::make_unique<Side>(type(), model(), m_sync);
  std::mutex m_log_mutex;
  std::vector<std::string> m_warnings;
  std::uint64_t m_per_stream{0};
  std::size_t m_streams_per_side{0};
};

// Everything sent arrives once, in order, intact; every key ends once; then a clean close.
TEST_P(Integrity, EveryMessageArrivesOnceInOrderAndEveryKeyEndsOnce) {
  const std::uint64_t total = messages_per_test();
  ASSERT_NO_FATAL_FAILURE(connect(total, 0));
  const std::uint64_t expected_per_side = m_per_stream * m_streams_per_side;
  const auto started = Clock::now();
  m_a->start();
  m_b->start();
  const bool delivered = m_sync.wait(
      [&] {
        return m_a->checker().received_total() == expected_per_side &&
               m_b->checker().received_total() == expected_per_side;
      },
      started + RUN_DEADLINE);
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  ASSERT_TRUE(delivered) << "received " << m_b->checker().received_total() << " and "
                         << m_a->checker().received_total() << " of " << expected_per_side
                         << " per side\n"
                         << errors();
  m_a->join();
  m_b->join();
  ASSERT_TRUE(m_a->all_sent() && m_b->all_sent());
  // Completions may trail the deliveries.
  EXPECT_TRUE(m_sync.wait(
      [&] {
        for (Side* side : {m_a.get(), m_b.get()}) {
          for (auto& conn : side->conns()) {
            if (conn->ledger.outstanding() != 0) return false;
          }
        }
        return true;
      },
      Clock::now() + test::DEFAULT_TIMEOUT))
      << "completions missing\n"
      << errors();
  close_all();
  const auto [accepted, completed, cancelled] = check_ledgers();
  EXPECT_EQ(accepted, 2 * expected_per_side);
  EXPECT_EQ(cancelled, 0U) << "a clean close after every completion cancels nothing";
  EXPECT_EQ(errors(), "");
  EXPECT_THAT(protocol_errors(), ::testing::IsEmpty());
  std::printf("[ measure  ] %s %s: %llu messages in %.2f s (%.0f msg/s), %llu completed\n",
              std::string{to_string(type())}.c_str(), std::string{to_string(model())}.c_str(),
              static_cast<unsigned long long>(2 * expected_per_side), seconds,
              static_cast<double>(2 * expected_per_side) / seconds,
              static_cast<unsigned long long>(completed));
}

// Closing every connection while both directions are busy: what arrived is a gap-free
// prefix of each stream, and every accepted key ends exactly once (completed or cancelled).
TEST_P(Integrity, CloseUnderLoadEndsEveryAcceptedKeyOnce) {
  const std::uint64_t total = std::numeric_limits<std::uint32_t>::max();  // until the close
  const std::uint64_t threshold = std::min<std::uint64_t>(messages_per_test() / 20, 50'000);
  ASSERT_NO_FATAL_FAILURE(connect(total, threshold));
  m_a->closing_expected = true;
  m_b->closing_expected = true;
  m_a->start();
  m_b->start();
  ASSERT_TRUE(m_sync.wait(
      [&] {
        return m_a->checker().received_total() >= threshold &&
               m_b->checker().received_total() >= threshold;
      },
      Clock::now() + RUN_DEADLINE))
      << errors();
  close_all();
  {
    const std::lock_guard lock{m_sync.mutex};
    m_sync.stop = true;
  }
  m_sync.cv.notify_all();
  m_a->join();
  m_b->join();
  const auto [accepted, completed, cancelled] = check_ledgers();
  EXPECT_EQ(errors(), "");
  EXPECT_THAT(protocol_errors(), ::testing::IsEmpty());
  EXPECT_GE(accepted, 2 * threshold);
  std::printf("[ measure  ] %s %s: %llu accepted, %llu completed, %llu cancelled at the close\n",
              std::string{to_string(type())}.c_str(), std::string{to_string(model())}.c_str(),
              static_cast<unsigned long long>(accepted), static_cast<unsigned long long>(completed),
              static_cast<unsigned long long>(cancelled));
}

std::vector<Param> params() {
  std::vector<Param> all;
  for (const BackendType type : Netio3Backend::available()) {
    for (const auto model : {ThreadSafetyModel::SAFE, ThreadSafetyModel::UNSAFE}) {
      all.emplace_back(type, model);
    }
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Backends, Integrity, ::testing::ValuesIn(params()),
                         [](const ::testing::TestParamInfo<Param>& p) {
                           return fmt::format("{}_{}", to_string(std::get<0>(p.param)),
                                              to_string(std::get<1>(p.param)));
                         });

}  // namespace
}  // namespace netio3::reliability
