// The ready-to-send callback (NetworkConfig::on_ready_to_send_cb) on every backend, SAFE and
// UNSAFE, against a receiver in another process (this binary, started again):
// - a receiver stopped with SIGSTOP: the sender runs into NO_RESOURCES (or an empty pool);
//   while the receiver is stopped the callback does not come and the sender's loop sleeps;
//   after SIGCONT it comes once, right after the first completion, and not again when the
//   rest of the backlog completes;
// - a sender that sends only from the callback (and the established callback), never
//   retrying on its own, delivers a million messages in order.

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "backend_cases.hpp"
#include "test_support.hpp"

namespace netio3::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* RECEIVER_ENV = "NETIO3_READY_RECEIVER";  // "<backend> <message size>"
constexpr std::size_t RECV_BUF = 4096;

// Message `n` of `size` bytes (at least 8): n in the first 8 bytes, then a byte pattern of n.
void fill(std::uint8_t* out, std::size_t size, std::uint64_t n) {
  std::memcpy(out, &n, sizeof n);
  for (std::size_t i = sizeof n; i < size; ++i) out[i] = static_cast<std::uint8_t>(n * 31 + i);
}

bool is_message(std::span<const std::uint8_t> bytes, std::size_t size, std::uint64_t n) {
  if (bytes.size() != size) return false;
  std::uint64_t got = 0;
  std::memcpy(&got, bytes.data(), sizeof got);
  if (got != n) return false;
  for (std::size_t i = sizeof n; i < size; ++i) {
    if (bytes[i] != static_cast<std::uint8_t>(n * 31 + i)) return false;
  }
  return true;
}

// The receiver process: listens, prints "LISTENING <port>", checks that message n is the
// n-th to arrive, and when the sender closes prints "DONE received=<n> bad=<b>". Runs only
// when a test below starts this binary with RECEIVER_ENV set.
TEST(DISABLED_ReadyReceiver, Run) {
  const char* env = std::getenv(RECEIVER_ENV);
  ASSERT_NE(env, nullptr) << "started by the ReadyToSend tests";
  char name[32] = {};
  std::size_t size = 0;
  ASSERT_EQ(std::sscanf(env, "%31s %zu", name, &size), 2) << env;  // NOLINT
  const auto type = parse_backend_type(name);
  ASSERT_TRUE(type.has_value()) << name;
  std::mutex mutex;
  std::condition_variable cv;
  bool closed = false;
  std::uint64_t received = 0;  // loop thread
  std::uint64_t bad = 0;
  NetworkConfig config{.mode = mode_for(*type)};
  config.on_data_cb = [&](std::span<const std::uint8_t> bytes) {
    if (!is_message(bytes, size, received)) ++bad;
    ++received;
  };
  config.on_connection_closed_cb = [&](const EndPointAddress&, const std::vector<std::uint64_t>&) {
    const std::lock_guard lock{mutex};
    closed = true;
    cv.notify_all();
  };
  LoopThread loop;
  auto backend = Netio3Backend::create(*type, std::move(config), loop.loop());
  const auto listen = backend->open_listen_endpoint(
      {test_address(), 0},
      ConnectionParameters{.recv_params = {.buf_size = RECV_BUF, .num_buf = 64}});
  std::printf("LISTENING %u\n", unsigned{listen.port});
  (void)std::fflush(stdout);
  {
    std::unique_lock lock{mutex};
    ASSERT_TRUE(cv.wait_for(lock, 600s, [&] { return closed; })) << "the sender never closed";
  }
  std::uint64_t got = 0;
  std::uint64_t wrong = 0;
  loop.loop()->run_sync([&] {
    got = received;
    wrong = bad;
  });
  std::printf("DONE received=%llu bad=%llu\n", static_cast<unsigned long long>(got),  // NOLINT
              static_cast<unsigned long long>(wrong));
  (void)std::fflush(stdout);
}

// What the sender's callbacks saw, with times.
struct Log {
  mutable std::mutex mutex;
  std::condition_variable cv;
  bool established{false};
  bool closed{false};
  std::uint64_t completed{0};
  std::vector<Clock::time_point> completions;  // only while `timing`
  std::vector<Clock::time_point> ready;
  bool timing{false};

  template <typename Pred>
  bool wait(Pred pred, Clock::time_point deadline) {
    std::unique_lock lock{mutex};
    return cv.wait_until(lock, deadline, [&] { return pred(*this); });
  }
  template <typename F>
  void update(F f) {
    {
      const std::lock_guard lock{mutex};
      f(*this);
    }
    cv.notify_all();
  }
};

class ReadyToSend : public ::testing::TestWithParam<BackendCase> {
 protected:
  // Starts the receiver for messages of `size` bytes; its address.
  EndPointAddress start_receiver(std::size_t size) {
    const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
    receiver.emplace(std::vector<std::string>{
        "env", fmt::format("{}={} {}", RECEIVER_ENV, to_string(GetParam().type), size), self,
        "--gtest_also_run_disabled_tests", "--gtest_filter=DISABLED_ReadyReceiver.Run"});
    std::optional<std::uint16_t> port;
    const bool listening = receiver->read_until(
        [&](const std::string& out) {
          const auto at = out.find("LISTENING ");
          if (at == std::string::npos || out.find('\n', at) == std::string::npos) return false;
          port = static_cast<std::uint16_t>(std::stoul(out.substr(at + 10)));
          return true;
        },
        Clock::now() + 60s);
    EXPECT_TRUE(listening) << receiver->describe();
    return {test_address(), port.value_or(0)};
  }

  // A NetworkConfig feeding `log`, with `on_ready` (on the loop thread) after logging.
  NetworkConfig config(const std::function<void()>& on_ready,
                       const std::function<void()>& on_established = {}) {
    NetworkConfig c{.mode = mode_for(GetParam().type), .thread_safety = GetParam().model};
    c.on_connection_established_cb = [this, on_established](const EndPointAddress&,
                                                            EndpointCapabilities) {
      log.update([](Log& l) { l.established = true; });
      if (on_established) on_established();
    };
    c.on_connection_closed_cb = [this](const EndPointAddress&,
                                       const std::vector<std::uint64_t>& keys) {
      EXPECT_TRUE(keys.empty()) << keys.size() << " sends cancelled";
      log.update([](Log& l) { l.closed = true; });
    };
    c.on_send_completed_cb = [this](const EndPointAddress&, std::uint64_t) {
      const auto now = Clock::now();
      log.update([&](Log& l) {
        ++l.completed;
        if (l.timing) l.completions.push_back(now);
      });
    };
    c.on_ready_to_send_cb = [this, on_ready](const EndPointAddress& remote) {
      EXPECT_EQ(remote, to);
      const auto now = Clock::now();
      log.update([&](Log& l) { l.ready.push_back(now); });
      if (on_ready) on_ready();
    };
    return c;
  }

  // Runs `f` as the thread-safety model allows (UNSAFE: on the loop thread).
  void api(const std::function<void()>& f) {
    if (GetParam().model == ThreadSafetyModel::UNSAFE) {
      loop.loop()->run_sync(f);
    } else {
      f();
    }
  }

  // Closes the connection and checks the receiver's count.
  void close_and_check(std::uint64_t sent, std::size_t size) {
    api([&] { backend->close_active_endpoint(to); });
    ASSERT_TRUE(log.wait([](const Log& l) { return l.closed; }, Clock::now() + 60s));
    ASSERT_TRUE(receiver->read_until(
        [](const std::string& out) { return out.find("DONE ") != std::string::npos; },
        Clock::now() + 60s))
        << receiver->describe();
    const auto at = receiver->out().find("DONE ");
    EXPECT_EQ(receiver->out().substr(at, receiver->out().find('\n', at) - at),
              fmt::format("DONE received={} bad=0", sent))
        << "messages of " << size << " bytes";
    EXPECT_EQ(receiver->wait(), 0) << receiver->describe();
  }

  Log log;
  LoopThread loop;
  std::optional<ChildProcess> receiver;
  std::unique_ptr<NetworkBackend> backend;  // destroyed before the loop
  EndPointAddress to;
};

// ---- A stopped receiver ---------------------------------------------------------------

constexpr std::size_t STOP_SIZE = 4096;
constexpr std::size_t STOP_NUM_BUF = 256;
constexpr std::size_t STOP_MAX_UNSENT = std::size_t{1} << 20U;
constexpr auto STOPPED_FOR = 1500ms;
// A refusal not followed by a callback for this long: the sender has stalled.
constexpr auto SETTLE = 1s;
// "Within 20 ms of the first completion after SIGCONT" (the bound).
constexpr auto READY_WITHIN = 20ms;
// The sender's loop while its peer is stopped and nothing is retried: heartbeats only
// (limits.peer_timeout 30 s: one every 3 s), and whatever the transport's own timers add.
constexpr double MAX_WAKEUPS_PER_S = 5.0;

TEST_P(ReadyToSend, ComesOnceAfterAStoppedReceiverResumesAndNotWhileItIsStopped) {
  to = start_receiver(STOP_SIZE);
  ASSERT_NE(to.port, 0);
  auto c = config({});
  c.limits.max_unsent_bytes = STOP_MAX_UNSENT;
  backend = Netio3Backend::create(GetParam().type, std::move(c), loop.loop());
  const ConnectionParameters params{
      .recv_params = {.buf_size = RECV_BUF, .num_buf = 4},
      .send_buffered_params = {.buf_size = STOP_SIZE, .num_buf = STOP_NUM_BUF}};
  api([&] { backend->open_active_endpoint(to, params); });
  ASSERT_TRUE(log.wait([](const Log& l) { return l.established; }, Clock::now() + 60s));

  std::uint64_t sent = 0;
  NetworkBuffer* held = nullptr;  // filled with message `sent`, refused, kept for the retry
  // Sends until refused (true) - a full pool or NO_RESOURCES - or `limit` messages went.
  const auto send_until_refused = [&](std::uint64_t limit) {
    bool refused = false;
    api([&] {
      while (sent < limit) {
        NetworkBuffer* buffer = held;
        if (buffer == nullptr) {
          buffer = backend->get_buffer(to);
          if (buffer == nullptr) {
            refused = true;
            return;
          }
          fill(buffer->data(), STOP_SIZE, sent);
          buffer->resize(STOP_SIZE);
        }
        const auto status = backend->send_buffer(to, buffer);
        if (status == NetioStatus::NO_RESOURCES) {
          held = buffer;
          refused = true;
          return;
        }
        ASSERT_EQ(status, NetioStatus::OK);
        held = nullptr;
        ++sent;
      }
    });
    return refused;
  };
  // Warm-up with the receiver reading.
  ASSERT_FALSE(send_until_refused(100));
  ASSERT_TRUE(log.wait([&](const Log& l) { return l.completed == sent; }, Clock::now() + 60s));

  // ---- The receiver stops. The sender sends again after every callback until it stalls:
  // the sockets' buffers (the receiving kernel keeps reading for a while) and then the pool
  // or max_unsent_bytes fill, and a refusal is followed by no callback for SETTLE.
  ASSERT_TRUE(receiver->stop()) << receiver->describe();
  const auto ready_count = [&] {
    const std::lock_guard lock{log.mutex};
    return log.ready.size();
  };
  const auto stall_deadline = Clock::now() + 60s;
  std::size_t episodes = 0;
  for (;;) {
    ASSERT_LT(Clock::now(), stall_deadline) << "never stalled; " << sent << " messages accepted";
    const auto before = ready_count();
    if (!send_until_refused(sent + 10'000)) continue;
    ++episodes;
    if (!log.wait([&](const Log& l) { return l.ready.size() > before; }, Clock::now() + SETTLE)) {
      break;
    }
  }
  const auto callbacks_before = ready_count();
  EXPECT_EQ(callbacks_before, episodes - 1) << "one callback for every episode but the open one";
  // Nothing more is tried. While the receiver is stopped the callback must not come (waited
  // out) and the loop sleeps.
  const auto wakeups_before = loop.loop()->wakeups();
  const auto quiet_from = Clock::now();
  EXPECT_FALSE(log.wait([&](const Log& l) { return l.ready.size() > callbacks_before; },
                        quiet_from + STOPPED_FOR))
      << "on_ready_to_send_cb came while the receiver was stopped";
  const double seconds = std::chrono::duration<double>(Clock::now() - quiet_from).count();
  const double wakeups_per_s =
      static_cast<double>(loop.loop()->wakeups() - wakeups_before) / seconds;
  std::printf(
      "[ measure  ] %s: %zu episodes before the sender stalled; its loop woke %.1f times/s "
      "while the receiver was stopped\n",
      backend_case_name(GetParam()).c_str(), episodes, wakeups_per_s);
  EXPECT_LE(wakeups_per_s, MAX_WAKEUPS_PER_S);

  // ---- The receiver continues: one callback, right after the first completion.
  log.update([](Log& l) { l.timing = true; });
  const auto cont_at = Clock::now();
  receiver->signal(SIGCONT);
  ASSERT_TRUE(
      log.wait([&](const Log& l) { return l.ready.size() > callbacks_before; }, Clock::now() + 60s))
      << "no on_ready_to_send_cb after SIGCONT";
  {
    const std::lock_guard lock{log.mutex};
    ASSERT_FALSE(log.completions.empty()) << "the callback came before any send completed";
    const auto first = log.completions.front();
    EXPECT_GE(first, cont_at);
    const auto ready = log.ready.at(callbacks_before);
    EXPECT_GE(ready, first) << "the callback came before the first completion";
    const auto late = std::chrono::duration_cast<std::chrono::microseconds>(ready - first);
    std::printf("[ measure  ] callback %lld us after the first completion after SIGCONT\n",
                static_cast<long long>(late.count()));
    EXPECT_LE(late, READY_WITHIN);
  }
  // The backlog completes; without a new refusal there is no second callback (edge-triggered:
  // one per episode, not one per buffer).
  ASSERT_TRUE(log.wait([&](const Log& l) { return l.completed == sent; }, Clock::now() + 60s));
  EXPECT_EQ(backend->statistics(to).keys_in_flight, 0U);
  EXPECT_EQ(ready_count(), callbacks_before + 1) << "more than one callback for one episode";

  // The refused buffer goes too; every accepted message arrives once, in order.
  ASSERT_FALSE(send_until_refused(sent + 1));
  ASSERT_TRUE(log.wait([&](const Log& l) { return l.completed == sent; }, Clock::now() + 60s));
  close_and_check(sent, STOP_SIZE);
}

// ---- A sender driven by the callback only ----------------------------------------------

constexpr std::size_t PUMP_SIZE = 64;
// Also under the sanitizers (measured under TSan: 50,000-80,000 messages/s, ~20 s a case).
constexpr std::uint64_t PUMP_MESSAGES = 1'000'000;

TEST_P(ReadyToSend, ASenderDrivenOnlyByTheCallbackDeliversEveryMessageInOrder) {
  to = start_receiver(PUMP_SIZE);
  ASSERT_NE(to.port, 0);
  // Loop thread only.
  std::uint64_t sent = 0;
  NetworkBuffer* held = nullptr;
  bool blocked = false;
  std::uint64_t refusals = 0;
  std::uint64_t spurious = 0;  // callbacks while nothing was refused
  std::uint64_t pumps = 0;
  // Sends until refused or done; never waits, never retries on its own.
  const auto pump = [&] {
    ++pumps;
    while (sent < PUMP_MESSAGES) {
      NetworkBuffer* buffer = held;
      if (buffer == nullptr) {
        buffer = backend->get_buffer(to);
        if (buffer == nullptr) break;
        fill(buffer->data(), PUMP_SIZE, sent);
        buffer->resize(PUMP_SIZE);
      }
      const auto status = backend->send_buffer(to, buffer);
      if (status == NetioStatus::NO_RESOURCES) {
        held = buffer;
        break;
      }
      if (status != NetioStatus::OK) {
        ADD_FAILURE() << "send_buffer: " << to_string(status);
        return;
      }
      held = nullptr;
      ++sent;
    }
    if (sent < PUMP_MESSAGES) {
      blocked = true;
      ++refusals;
    }
  };
  backend = Netio3Backend::create(GetParam().type,
                                  config(
                                      [&] {
                                        if (!blocked) ++spurious;
                                        blocked = false;
                                        pump();
                                      },
                                      pump),
                                  loop.loop());
  const ConnectionParameters params{
      .recv_params = {.buf_size = RECV_BUF, .num_buf = 4},
      .send_buffered_params = {.buf_size = PUMP_SIZE, .num_buf = 256}};
  const auto started = Clock::now();
  api([&] { backend->open_active_endpoint(to, params); });
  ASSERT_TRUE(log.wait([](const Log& l) { return l.completed == PUMP_MESSAGES || l.closed; },
                       Clock::now() + 300s))
      << log.completed << " of " << PUMP_MESSAGES << " completed";
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  loop.loop()->run_sync([&] {
    EXPECT_EQ(sent, PUMP_MESSAGES);
    EXPECT_EQ(spurious, 0U);
    EXPECT_GT(refusals, 0U) << "never refused: the callback was not exercised";
    std::printf(
        "[ measure  ] %s: %llu messages in %.2f s (%.0f/s), %llu refusals, %llu sends from "
        "the callback\n",
        backend_case_name(GetParam()).c_str(), static_cast<unsigned long long>(PUMP_MESSAGES),
        seconds, static_cast<double>(PUMP_MESSAGES) / seconds,
        static_cast<unsigned long long>(refusals), static_cast<unsigned long long>(pumps - 1));
  });
  {
    const std::lock_guard lock{log.mutex};
    // One callback per refusal episode: every refusal but one still open at the end (none).
    EXPECT_EQ(log.ready.size(), refusals);
  }
  close_and_check(PUMP_MESSAGES, PUMP_SIZE);
}

// A sender that never lets the loop run - it sends from the loop thread until refused, as a
// sender driven by the callback does - is refused within the backend's limits even when its
// peer keeps up (UCX completes small sends at once; their reports count until handed out),
// and the callback then comes.
TEST_P(ReadyToSend, ASenderThatKeepsTheLoopBusyIsRefusedAndThenCalledBack) {
  if (GetParam().type == BackendType::LIBFABRIC) {
    GTEST_SKIP() << "libfabric: send_data_copy is NotSupported (docs/libfabric.md)";
  }
  to = start_receiver(PUMP_SIZE);
  ASSERT_NE(to.port, 0);
  backend = Netio3Backend::create(GetParam().type, config({}), loop.loop());
  api([&] {
    backend->open_active_endpoint(
        to, ConnectionParameters{.recv_params = {.buf_size = RECV_BUF, .num_buf = 4}});
  });
  ASSERT_TRUE(log.wait([](const Log& l) { return l.established; }, Clock::now() + 60s));
  // Far more than max_unsent_bytes (8 MiB) holds: refused long before unless unbounded.
  constexpr std::uint64_t CAP = 2'000'000;
  std::uint64_t sent = 0;
  loop.loop()->run_sync([&] {
    std::array<std::uint8_t, PUMP_SIZE> message{};
    for (; sent < CAP; ++sent) {
      fill(message.data(), PUMP_SIZE, sent);
      const auto status =
          backend->send_data_copy(to, std::span<const std::uint8_t>{message}, {}, sent);
      if (status == NetioStatus::NO_RESOURCES) break;
      ASSERT_EQ(status, NetioStatus::OK);
    }
  });
  EXPECT_LT(sent, CAP) << "never refused";
  ASSERT_TRUE(log.wait([](const Log& l) { return !l.ready.empty(); }, Clock::now() + 60s));
  ASSERT_TRUE(log.wait([&](const Log& l) { return l.completed == sent; }, Clock::now() + 60s));
  close_and_check(sent, PUMP_SIZE);
}

INSTANTIATE_TEST_SUITE_P(Backends, ReadyToSend, ::testing::ValuesIn(backend_cases()),
                         [](const auto& param_info) { return backend_case_name(param_info); });

}  // namespace
}  // namespace netio3::test
