// Connection churn and concurrent use (label `reliability`), for every backend compiled in:
// - 1000 connect/send/close cycles leave the file-descriptor count and RSS at baseline;
// - a listener closed while connections to it are being set up ends every one of them
//   with exactly one outcome, and nothing is left behind;
// - SAFE mode hammered from many threads (open, close, get_buffer, sends at once) keeps
//   the key accounting exact.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "test_support.hpp"
#include "traffic.hpp"

namespace netio3::reliability {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::Recorder;
using Kind = Recorder::Kind;

constexpr std::size_t BUF = 4096;

ConnectionParameters endpoint_params() {
  return ConnectionParameters{.recv_params = {.buf_size = BUF, .num_buf = 8},
                              .send_buffered_params = {.buf_size = BUF, .num_buf = 8}};
}

// Waits until `probe()` is at most `limit` (for quantities no callback announces: fds).
template <typename Probe>
bool settles_below(Probe probe, std::size_t limit, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (probe() > limit) {
    if (Clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// What the open fds are (for failure messages).
std::string describe_fds() {
  std::string out;
  for (const auto& entry : std::filesystem::directory_iterator{"/proc/self/fd"}) {
    std::error_code ec;
    out += fmt::format(" {}->{}", entry.path().filename().string(),
                       std::filesystem::read_symlink(entry.path(), ec).string());
  }
  return out;
}

class Churn : public ::testing::TestWithParam<BackendType> {
 protected:
  [[nodiscard]] std::unique_ptr<NetworkBackend> make(
      Recorder& rec, test::LoopThread& loop,
      ThreadSafetyModel model = ThreadSafetyModel::SAFE) const {
    return Netio3Backend::create(GetParam(), rec.config(model, test::mode_for(GetParam())),
                                 loop.loop());
  }
};

// ---- 1000 connect/close cycles, client and server in two processes -------------------
// (One process each, as in a deployment: several UCX workers in one process churning
// connections trip an assertion inside UCX 1.13, async.c:643, and a UCX worker connected
// to itself keeps five sockets per closed connection; see docs/ucx.md.)

constexpr std::size_t WARMUP = 30;
constexpr std::size_t CYCLES = 1000;
constexpr const char* CHURN_CLIENT_ENV = "NETIO3_CHURN_CLIENT";  // "<backend> <port>"

// The client process: WARMUP + CYCLES times connect, send one message, close; its own fd
// count and RSS must come back to what they were after the warm-up. Runs only when the
// server test below starts this binary with CHURN_CLIENT_ENV set.
TEST(DISABLED_ChurnClient, Cycles) {
  const char* env = std::getenv(CHURN_CLIENT_ENV);
  ASSERT_NE(env, nullptr) << "started by Churn.ThousandConnectCloseCyclesReturnToBaseline";
  char name[32] = {};
  unsigned port = 0;
  ASSERT_EQ(std::sscanf(env, "%31s %u", name, &port), 2) << env;  // NOLINT
  const auto type = parse_backend_type(name);
  ASSERT_TRUE(type.has_value()) << name;
  const EndPointAddress listen{test::test_address(), static_cast<std::uint16_t>(port)};
  Recorder rec;
  rec.keep_data(false);
  test::LoopThread loop;
  auto backend = Netio3Backend::create(
      *type, rec.config(ThreadSafetyModel::SAFE, test::mode_for(*type)), loop.loop());
  const auto cycle = [&](std::size_t n) {
    backend->open_active_endpoint(listen, endpoint_params());
    ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == n + 1; }))
        << "cycle " << n;
    NetworkBuffer* buffer = backend->get_buffer(listen);
    ASSERT_NE(buffer, nullptr);
    buffer->write(test::pattern(n, 100 + n % 1000));
    ASSERT_EQ(backend->send_buffer(listen, buffer), NetioStatus::OK);
    ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::COMPLETED) == n + 1; }))
        << "cycle " << n;
    backend->close_active_endpoint(listen);
    ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == n + 1; }))
        << "cycle " << n;
  };
  for (std::size_t n = 0; n < WARMUP; ++n) ASSERT_NO_FATAL_FAILURE(cycle(n));
  const std::size_t fds = test::open_fd_count();
  const std::size_t rss = test::rss_bytes();
  const auto started = Clock::now();
  for (std::size_t n = WARMUP; n < WARMUP + CYCLES; ++n) ASSERT_NO_FATAL_FAILURE(cycle(n));
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  EXPECT_TRUE(settles_below(test::open_fd_count, fds, 10s))
      << "client fds: " << fds << " before, " << test::open_fd_count()
      << " after:" << describe_fds();
  const double growth_mib =
      (static_cast<double>(test::rss_bytes()) - static_cast<double>(rss)) / (1024.0 * 1024.0);
  if constexpr (!test::SANITIZED) {
    EXPECT_LT(growth_mib, 8.0) << "client RSS grew by " << growth_mib << " MiB";
  }
  std::printf("CLIENT %zu cycles in %.2f s (%.2f ms each), fds %zu -> %zu, RSS %+.2f MiB\n", CYCLES,
              seconds, 1000.0 * seconds / CYCLES, fds, test::open_fd_count(), growth_mib);
}

// The server: accepts WARMUP + CYCLES connections from the client process, checks every
// message, and comes back to its fd count and RSS after the warm-up. Nothing per
// connection may stay behind in either process; allocator noise and lazily touched pages of
// the transports stay well below 8 MiB. Under the sanitizers freed memory is held back on
// purpose (ASan's quarantine, TSan's allocator), so RSS is not checked there; leaks are
// LeakSanitizer's job in that build.
TEST_P(Churn, ThousandConnectCloseCyclesReturnToBaseline) {
  Recorder rec;
  rec.keep_data(false);
  std::atomic<std::size_t> arrived{0};
  std::atomic<std::size_t> intact{0};
  std::atomic<std::size_t> fds{0};
  std::atomic<std::size_t> rss{0};
  std::atomic<std::size_t> closed{0};
  rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t> bytes) {
    if (e.kind == Kind::DATA) {
      const std::size_t n = arrived++;
      if (bytes.size() == 100 + n % 1000 && test::matches_pattern(bytes, n)) ++intact;
    }
    if (e.kind == Kind::CLOSED && ++closed == WARMUP) {
      fds = test::open_fd_count();  // after the warm-up (perhaps with the next one opening)
      rss = test::rss_bytes();
    }
  });
  test::LoopThread loop;
  auto server = make(rec, loop);
  const auto listen = server->open_listen_endpoint({test::test_address(), 0}, endpoint_params());

  const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
  test::ChildProcess client{
      {"env", fmt::format("{}={} {}", CHURN_CLIENT_ENV, to_string(GetParam()), listen.port), self,
       "--gtest_also_run_disabled_tests", "--gtest_filter=DISABLED_ChurnClient.Cycles"}};
  const auto status = client.wait(Clock::now() + 240s);
  EXPECT_EQ(status, 0) << client.describe();
  ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == WARMUP + CYCLES; }))
      << "server saw " << rec.count_now(Kind::CLOSED) << " closes";
  EXPECT_EQ(rec.count_now(Kind::ESTABLISHED), WARMUP + CYCLES);
  EXPECT_EQ(intact.load(), WARMUP + CYCLES) << "of " << arrived.load() << " messages";
  EXPECT_TRUE(settles_below(test::open_fd_count, fds.load(), 10s))
      << "server fds: " << fds.load() << " after the warm-up, " << test::open_fd_count()
      << " after:" << describe_fds();
  const double growth_mib =
      (static_cast<double>(test::rss_bytes()) - static_cast<double>(rss.load())) /
      (1024.0 * 1024.0);
  if constexpr (!test::SANITIZED) {
    EXPECT_LT(growth_mib, 8.0) << "server RSS grew by " << growth_mib << " MiB";
  }
  const auto line = client.out().find("CLIENT ");
  std::printf("[ measure  ] %s: %s; server fds %zu -> %zu, RSS %+.2f MiB\n",
              std::string{to_string(GetParam())}.c_str(),
              line == std::string::npos
                  ? "client said nothing"
                  : client.out().substr(line, client.out().find('\n', line) - line).c_str(),
              fds.load(), test::open_fd_count(), growth_mib);
  loop.loop()->run_sync([&] { rec.set_hook(nullptr); });
}

// Clients connect to a listener that is closed at once: each one gets exactly one outcome
// (refused, or established and then closed), the server reports a close for every
// connection it reported established, and the fds come back. One backend is server and
// clients: it listens on 0.0.0.0 and connects through 127.0.0.1, 127.0.0.2, ... (distinct
// remote addresses for the same listener).
TEST_P(Churn, ListenerClosedDuringSetUpEndsEveryConnectionOnce) {
  constexpr std::size_t CLIENTS = 6;
  constexpr std::size_t ROUNDS = 10;
  // A client whose request the closing listener drops may only learn at its set-up
  // deadline (libfabric); keep that short. A closed listener's transport object is also
  // kept this long (common/closed_listeners.hpp), and its fd counts until it goes.
  constexpr auto CONNECT_TIMEOUT = 3s;
  const auto run_round = [&](std::size_t round) {
    test::LoopThread loop;
    Recorder rec;
    rec.keep_data(false);
    auto config = rec.config(ThreadSafetyModel::SAFE, test::mode_for(GetParam()));
    config.limits.connect_timeout = CONNECT_TIMEOUT;
    auto backend = Netio3Backend::create(GetParam(), std::move(config), loop.loop());
    const auto listen = backend->open_listen_endpoint({"0.0.0.0", 0}, endpoint_params());
    std::vector<EndPointAddress> clients;
    for (std::size_t i = 0; i < CLIENTS; ++i) {
      clients.push_back({fmt::format("127.0.0.{}", i + 1), listen.port});
    }
    // Start the clients in a different order each round, and close the listener after a
    // varying number of them.
    for (std::size_t i = 0; i < CLIENTS; ++i) {
      if (i == round % (CLIENTS + 1)) backend->close_listen_endpoint(listen);
      backend->open_active_endpoint(clients[(i + round) % CLIENTS], endpoint_params());
    }
    if (round % (CLIENTS + 1) == CLIENTS) backend->close_listen_endpoint(listen);
    const auto is_client = [&](const EndPointAddress& a) {
      return std::find(clients.begin(), clients.end(), a) != clients.end();
    };
    for (const auto& client : clients) {
      // Refused, or established and then closed (the listener's close closes what it
      // spawned, and the client sees its peer go); never both, never twice.
      ASSERT_TRUE(rec.wait([&](const Recorder& r) {
        return r.count(Kind::REFUSED, client) == 1 ||
               (r.count(Kind::ESTABLISHED, client) == 1 && r.count(Kind::CLOSED, client) == 1);
      })) << client
          << " round " << round;
    }
    // The accepted side: every connection reported established is reported closed.
    ASSERT_TRUE(rec.wait([&](const Recorder& r) {
      std::size_t established = 0;
      std::size_t closed = 0;
      for (const auto& e : r.events()) {
        if (is_client(e.remote)) continue;
        if (e.kind == Kind::ESTABLISHED) ++established;
        if (e.kind == Kind::CLOSED) ++closed;
      }
      return established == closed;
    })) << "round "
        << round;
    for (const auto& client : clients) {
      const auto events = rec.snapshot();
      const auto outcomes = std::count_if(events.begin(), events.end(), [&](const auto& e) {
        return e.remote == client && (e.kind == Kind::REFUSED || e.kind == Kind::CLOSED);
      });
      EXPECT_EQ(outcomes, 1) << client << " round " << round;
    }
    EXPECT_THROW(backend->close_listen_endpoint(listen), UnknownListenEndpoint);
    backend.reset();
  };
  run_round(0);  // the transports' one-time set-up (UCX opens some files once per process)
  const std::size_t fds = test::open_fd_count();
  for (std::size_t round = 1; round <= ROUNDS; ++round) {
    ASSERT_NO_FATAL_FAILURE(run_round(round));
  }
  EXPECT_TRUE(settles_below(test::open_fd_count, fds, 10s))
      << "fds: " << fds << " before, " << test::open_fd_count() << " after:" << describe_fds();
}

// SAFE mode from many threads at once: opening and closing endpoints, taking buffers and
// sending on endpoints that may close under the caller. Every send that returned OK ends
// exactly once, every endpoint opened ends with exactly one closed (or refused) callback.
TEST_P(Churn, SafeModeHammeredFromManyThreadsKeepsExactAccounts) {
  constexpr std::size_t TARGETS = 4;
  constexpr std::size_t OPENERS = 2;
  constexpr std::size_t SENDERS = 3;
  // Accepted sends to reach (all senders together).
  const std::size_t ops =
      std::getenv("NETIO3_RELIABILITY_MESSAGES") != nullptr &&
              std::strtoull(std::getenv("NETIO3_RELIABILITY_MESSAGES"), nullptr, 10) < 1'000'000
          ? 3000
          : 20000;

  std::mutex mutex;
  std::condition_variable cv;
  std::set<std::uint64_t> open_data_keys;  // accepted data sends not yet ended
  std::uint64_t buffered_ok = 0;
  std::uint64_t buffered_ended = 0;
  std::uint64_t closed_or_refused = 0;
  std::vector<std::string> errors;
  const auto end_key = [&](std::uint64_t key, const char* how) {
    if (key < DATA_KEY_BASE) {
      ++buffered_ended;
    } else if (open_data_keys.erase(key) != 1) {
      errors.push_back(fmt::format("{} of key {} that is not outstanding", how, key));
    }
  };

  // One backend listens and connects to itself: one event loop and, for UCX, one worker.
  // (Two UCX workers in one process churning connections trip assertions inside UCX 1.13 -
  // async.c:643 "handler->async == async", tcp_sockcm_ep.c:416 - seen in 2 of 5 runs of
  // this test with separate client and server backends, never in 8 with one.) Only the
  // active endpoints send; the accepted side only receives.
  std::vector<EndPointAddress> targets;
  // A NetworkBuffer* is valid until its connection's closed (or refused) callback
  // (docs/semantics.md), so a buffered sender holds its target's lock in shared mode from
  // get_buffer to send_buffer, and a close takes it exclusively: close_active_endpoint, and
  // the callbacks of an endpoint that ended otherwise (its peer closed it, or an error did).
  // Everything else runs concurrently.
  std::array<std::shared_mutex, TARGETS> target_locks;
  const auto lock_target = [&](const EndPointAddress& remote) {
    const auto it = std::find(targets.begin(), targets.end(), remote);
    if (it == targets.end()) return std::unique_lock<std::shared_mutex>{};
    return std::unique_lock{target_locks[static_cast<std::size_t>(it - targets.begin())]};
  };
  NetworkConfig config{.mode = test::mode_for(GetParam()),
                       .thread_safety = ThreadSafetyModel::SAFE};
  config.on_send_completed_cb = [&](const EndPointAddress&, std::uint64_t key) {
    const std::lock_guard lock{mutex};
    end_key(key, "completion");
  };
  config.on_connection_closed_cb = [&](const EndPointAddress& remote,
                                       const std::vector<std::uint64_t>& keys) {
    {
      const auto target_lock = lock_target(remote);  // owns a lock iff remote is a target
      const std::lock_guard lock{mutex};
      for (const auto key : keys) end_key(key, "cancellation");
      if (target_lock.owns_lock()) ++closed_or_refused;
    }
    cv.notify_all();
  };
  config.on_connection_refused_cb = [&](const EndPointAddress& remote) {
    {
      const auto target_lock = lock_target(remote);
      const std::lock_guard lock{mutex};
      ++closed_or_refused;
    }
    cv.notify_all();
  };

  test::LoopThread loop;
  auto client = Netio3Backend::create(GetParam(), std::move(config), loop.loop());
  for (std::size_t i = 0; i < TARGETS; ++i) {
    targets.push_back(client->open_listen_endpoint({test::test_address(), 0}, endpoint_params()));
  }
  const bool copy = GetParam() != BackendType::LIBFABRIC;

  std::atomic<std::uint64_t> opened{0};
  std::atomic<std::uint64_t> next_key{DATA_KEY_BASE};
  std::atomic<std::uint64_t> sent{0};
  std::atomic<std::size_t> senders_running{SENDERS};
  std::vector<std::jthread> threads;
  // Openers keep every target open most of the time: they reopen what is closed, and close
  // one now and then (one call in 16), while the senders run.
  for (std::size_t t = 0; t < OPENERS; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng{t + 1};
      while (senders_running.load() > 0) {
        const std::size_t target = rng() % TARGETS;
        const auto& to = targets[target];
        try {
          if (rng() % 16 != 0) {
            client->open_active_endpoint(to, endpoint_params());
            ++opened;
          } else {
            const std::unique_lock target_lock{target_locks[target]};
            client->close_active_endpoint(to);
          }
        } catch (const ActiveEndpointAlreadyExists&) {
          std::this_thread::yield();
        } catch (const UnknownActiveEndpoint&) {
        }
      }
    });
  }
  for (std::size_t t = 0; t < SENDERS; ++t) {
    threads.emplace_back([&, t] {
      const struct Done {
        std::atomic<std::size_t>& running;
        ~Done() { --running; }
      } done{senders_running};
      std::mt19937_64 rng{100 + t};
      std::vector<std::uint8_t> payload(512);
      const auto deadline = Clock::now() + 60s;
      while (sent.load() < ops && Clock::now() < deadline) {
        const std::size_t target = rng() % TARGETS;
        const auto& to = targets[target];
        std::optional<std::uint64_t> data_key;  // a data send in progress
        try {
          if (!copy || rng() % 2 == 0) {
            const std::shared_lock target_lock{target_locks[target]};
            NetworkBuffer* buffer = client->get_buffer(to);
            if (buffer == nullptr) {
              std::this_thread::yield();
              continue;
            }
            buffer->write(std::span<const std::uint8_t>{payload}.first(rng() % payload.size()));
            // The buffer goes back when its send ends; a failed send keeps it lent until
            // the connection closes, which the test does at the end.
            if (client->send_buffer(to, buffer) == NetioStatus::OK) {
              const std::lock_guard lock{mutex};
              ++buffered_ok;
              ++sent;
            }
          } else {
            const std::uint64_t key = next_key++;
            data_key = key;
            {
              const std::lock_guard lock{mutex};
              open_data_keys.insert(key);
            }
            const auto status = client->send_data_copy(
                to, std::span<const std::uint8_t>{payload}.first(rng() % payload.size()), {}, key);
            if (status == NetioStatus::OK) {
              ++sent;
            } else {
              const std::lock_guard lock{mutex};
              if (open_data_keys.erase(key) != 1) {
                errors.push_back(fmt::format("key {} ended although its send returned {}", key,
                                             to_string(status)));
              }
            }
          }
        } catch (const UnknownActiveEndpoint&) {
          // Not open at the moment (or closed in between): nothing was accepted.
          if (data_key) {
            const std::lock_guard lock{mutex};
            open_data_keys.erase(*data_key);
          }
        }
      }
    });
  }
  threads.clear();
  // Close what is still open and wait for every endpoint's one final callback.
  for (const auto& to : targets) {
    try {
      client->close_active_endpoint(to);
    } catch (const UnknownActiveEndpoint&) {
    }
  }
  {
    std::unique_lock lock{mutex};
    ASSERT_TRUE(cv.wait_for(lock, test::DEFAULT_TIMEOUT,
                            [&] { return closed_or_refused == opened.load(); }))
        << closed_or_refused << " of " << opened.load() << " endpoints ended";
  }
  client.reset();  // no callback after this
  const std::lock_guard lock{mutex};
  for (const auto& e : errors) ADD_FAILURE() << e;
  EXPECT_EQ(buffered_ok, buffered_ended) << "buffered sends accepted vs ended";
  EXPECT_TRUE(open_data_keys.empty()) << open_data_keys.size() << " accepted sends never ended";
  EXPECT_GE(sent.load(), ops) << "the hammer did not get its sends through within 60 s";
  std::printf("[ measure  ] %s: %llu endpoints opened, %llu sends accepted\n",
              std::string{to_string(GetParam())}.c_str(),
              static_cast<unsigned long long>(opened.load()),
              static_cast<unsigned long long>(sent.load()));
}

INSTANTIATE_TEST_SUITE_P(Backends, Churn, ::testing::ValuesIn(Netio3Backend::available()),
                         [](const ::testing::TestParamInfo<BackendType>& p) {
                           return std::string{to_string(p.param)};
                         });

}  // namespace
}  // namespace netio3::reliability
