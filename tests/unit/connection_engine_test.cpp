// The connection engine on its own, over FakeTransport (fake_transport.hpp): closing in every
// phase, closing and destroying from inside every callback, completions racing a close,
// every key ending exactly once, set-up deadlines, and no callback nested in another or run
// inside an API call. Every action on the fake runs on the loop thread, as a transport's would.

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "fake_transport.hpp"
#include "test_support.hpp"

namespace netio3::test {
namespace {

using namespace std::chrono_literals;
using Kind = Recorder::Kind;

thread_local int t_in_api = 0;       // an API call of the test is running on this thread
thread_local int t_in_callback = 0;  // a user callback is running on this thread

class Engine : public testing::TestWithParam<ThreadSafetyModel> {
 protected:
  void SetUp() override { make(); }

  void make(const std::function<void(NetworkConfig&)>& tweak = {}) {
    backend.reset();
    auto config = rec.config(GetParam());
    if (tweak) tweak(config);
    backend = std::make_unique<detail::BackendFacade<FakeTransport>>(config, loop.loop());
    fake = FakeTransport::latest();
    rec.set_hook([this](const Recorder::Event& e, std::span<const std::uint8_t>) {
      if (t_in_api > 0) problem("a callback ran inside an API call");
      if (t_in_callback > 0) problem("a callback ran inside another callback");
      ++t_in_callback;
      if (action) action(e);
      --t_in_callback;
    });
  }

  void TearDown() override {
    // No callback may touch the test's state once it is being torn down.
    rec.set_hook({});
    backend.reset();
    const std::lock_guard lock{mutex};
    EXPECT_TRUE(problems.empty()) << fmt::format("{}", fmt::join(problems, "\n"));
  }

  void problem(std::string what) {
    const std::lock_guard lock{mutex};
    problems.push_back(std::move(what));
  }

  // Runs f on the loop thread (where the transport acts).
  void on_loop(const std::function<void()>& f) { loop.loop()->run_sync(f); }
  // Calls the API on the loop thread, marked: no callback may run before it returns.
  void api(const std::function<void()>& f) {
    on_loop([&] {
      ++t_in_api;
      f();
      --t_in_api;
    });
  }
  // Lets everything posted so far run.
  void settle() {
    on_loop([] {});
    on_loop([] {});
  }

  std::shared_ptr<FakeConnection> conn(const EndPointAddress& remote) {
    std::shared_ptr<FakeConnection> c;
    on_loop([&] { c = fake->find(remote); });
    return c;
  }

  // An active connection to `to`, established.
  std::shared_ptr<FakeConnection> open(const EndPointAddress& to) {
    api([&] { backend->open_active_endpoint(to, params()); });
    auto c = conn(to);
    on_loop([&] {
      fake->connected(c);
      fake->establish(c);
    });
    return c;
  }

  static ConnectionParameters params() {
    return ConnectionParameters{.recv_params = {.buf_size = 64, .num_buf = 8},
                                .send_buffered_params = {.buf_size = 64, .num_buf = 8}};
  }

  NetioStatus send(const EndPointAddress& to, std::uint64_t key) {
    std::array<std::uint8_t, 4> payload{};
    return backend->send_data_copy(to, payload, {}, key);
  }

  // Every key in `accepted` ended exactly once for `remote` (completed or among the
  // cancelled keys of its one closed callback), none after the close.
  void expect_keys_end_once(const EndPointAddress& remote,
                            const std::vector<std::uint64_t>& accepted) {
    std::multiset<std::uint64_t> ended;
    int closed = 0;
    for (const auto& e : rec.snapshot()) {
      if (e.remote != remote) continue;
      if (e.kind == Kind::COMPLETED) {
        EXPECT_EQ(closed, 0) << "key " << e.key << " completed after the close";
        ended.insert(e.key);
      } else if (e.kind == Kind::CLOSED) {
        ++closed;
        ended.insert(e.keys.begin(), e.keys.end());
      }
    }
    EXPECT_EQ(closed, 1);
    EXPECT_EQ(ended, std::multiset<std::uint64_t>(accepted.begin(), accepted.end()));
  }

  Recorder rec;
  LoopThread loop;
  std::unique_ptr<NetworkBackend> backend;
  std::shared_ptr<FakeTransport> fake;
  std::function<void(const Recorder::Event&)> action;  // run inside callbacks (loop thread)
  std::mutex mutex;
  std::vector<std::string> problems;
  const EndPointAddress peer{"10.0.0.1", 5000};
};

TEST_P(Engine, ClosingInEveryPhaseEndsWithTheOneCallbackThatApplies) {
  struct Case {
    std::string name;
    bool accepted;          // opened by a peer, else by open_active_endpoint
    detail::Phase reached;  // how far set-up got
    bool by_application;    // close_active_endpoint, else the transport failed
    Kind expected;          // or DATA for "no callback"
  };
  const std::vector<Case> cases{
      {"active, connecting, closed", false, detail::Phase::CONNECTING, true, Kind::CLOSED},
      {"active, connecting, failed", false, detail::Phase::CONNECTING, false, Kind::REFUSED},
      {"active, handshake, closed", false, detail::Phase::HANDSHAKE, true, Kind::CLOSED},
      {"active, handshake, failed", false, detail::Phase::HANDSHAKE, false, Kind::REFUSED},
      {"active, open, closed", false, detail::Phase::OPEN, true, Kind::CLOSED},
      {"active, open, failed", false, detail::Phase::OPEN, false, Kind::CLOSED},
      {"accepted, handshake, closed", true, detail::Phase::HANDSHAKE, true, Kind::DATA},
      {"accepted, handshake, failed", true, detail::Phase::HANDSHAKE, false, Kind::DATA},
      {"accepted, open, closed", true, detail::Phase::OPEN, true, Kind::CLOSED},
      {"accepted, open, failed", true, detail::Phase::OPEN, false, Kind::CLOSED},
  };
  EndPointAddress listen;
  api([&] { listen = backend->open_listen_endpoint({"127.0.0.1", 0}, params()); });
  std::uint16_t port = 6000;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const EndPointAddress remote{"10.0.0.2", ++port};
    std::shared_ptr<FakeConnection> connection;
    if (c.accepted) {
      on_loop([&] { connection = fake->accept(listen, remote); });
    } else {
      api([&] { backend->open_active_endpoint(remote, params()); });
      connection = conn(remote);
    }
    ASSERT_NE(connection, nullptr);
    on_loop([&] {
      if (c.reached >= detail::Phase::HANDSHAKE) fake->connected(connection);
      if (c.reached == detail::Phase::OPEN) fake->establish(connection);
    });
    if (c.by_application) {
      api([&] { backend->close_active_endpoint(remote); });
    } else {
      on_loop([&] { fake->fails(connection, "the transport failed"); });
    }
    // A second end of the same connection is ignored.
    on_loop([&] { fake->peer_closes(connection); });
    settle();
    const auto events = rec.snapshot();
    std::size_t ends = 0;
    for (const auto& e : events) {
      if (e.remote != remote) continue;
      if (e.kind == Kind::CLOSED || e.kind == Kind::REFUSED) {
        ++ends;
        EXPECT_EQ(e.kind, c.expected);
      }
    }
    EXPECT_EQ(ends, c.expected == Kind::DATA ? 0U : 1U);
    EXPECT_EQ(connection->phase, detail::Phase::CLOSED);
    api([&] { EXPECT_THROW(backend->close_active_endpoint(remote), UnknownActiveEndpoint); });
  }
}

TEST_P(Engine, TheEndIsReportedOnceTheTransportHoldsNothingAndNeverInsideTheCall) {
  const auto c = open(peer);
  std::vector<std::uint64_t> accepted;
  api([&] {
    for (std::uint64_t key = 1; key <= 3; ++key) {
      ASSERT_EQ(send(peer, key), NetioStatus::OK);
      accepted.push_back(key);
    }
    backend->close_active_endpoint(peer);
    // Closed: no send is taken any more, and the address is free again.
    EXPECT_THROW((void)send(peer, 99), UnknownActiveEndpoint);
  });
  settle();
  EXPECT_EQ(rec.count_now(Kind::CLOSED), 0U) << "reported while sends were in flight";
  on_loop([&] {
    fake->complete_one(c);
    fake->complete_one(c);
  });
  settle();
  EXPECT_EQ(rec.count_now(Kind::CLOSED), 0U);
  EXPECT_EQ(rec.count_now(Kind::COMPLETED), 2U);
  // The last completion is reported, then the end, after the transport's call returned.
  on_loop([&] { fake->complete_one(c); });
  ASSERT_TRUE(rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  expect_keys_end_once(peer, accepted);
  const auto events = rec.snapshot();
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind, Kind::CLOSED);
  EXPECT_TRUE(events.back().keys.empty());
}

TEST_P(Engine, AnErrorCancelsWhatIsInFlightAndReportsAtOnce) {
  const auto c = open(peer);
  std::vector<std::uint64_t> accepted;
  api([&] {
    for (std::uint64_t key = 1; key <= FakeTransport::WINDOW; ++key) {
      ASSERT_EQ(send(peer, key), NetioStatus::OK);
      accepted.push_back(key);
    }
    EXPECT_EQ(send(peer, 100), NetioStatus::NO_RESOURCES);
  });
  on_loop([&] {
    fake->complete_one(c);
    fake->fails(c, "link down");
    // Cancelled sends do not complete later.
    EXPECT_FALSE(fake->complete_one(c));
  });
  ASSERT_TRUE(rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  expect_keys_end_once(peer, accepted);
  EXPECT_EQ(rec.snapshot().back().keys.size(), FakeTransport::WINDOW - 1);
}

TEST_P(Engine, ClosingTheListenerEndsItsConnectionsAfterTheCall) {
  EndPointAddress listen;
  api([&] { listen = backend->open_listen_endpoint({"127.0.0.1", 0}, params()); });
  std::vector<std::shared_ptr<FakeConnection>> children;
  on_loop([&] {
    for (std::uint16_t i = 0; i < 3; ++i) {
      auto c = fake->accept(listen, {"10.0.0.3", static_cast<std::uint16_t>(7000 + i)});
      fake->connected(c);
      fake->establish(c);
      children.push_back(c);
    }
    // A second connection from an address and port in use is refused.
    EXPECT_EQ(fake->accept(listen, {"10.0.0.3", 7000}), nullptr);
  });
  ASSERT_EQ(rec.count_now(Kind::ESTABLISHED), 3U);
  api([&] { backend->close_listen_endpoint(listen); });
  ASSERT_TRUE(rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) == 3; }));
  on_loop([&] { EXPECT_EQ(fake->accept(listen, {"10.0.0.3", 7100}), nullptr); });
  for (const auto& c : children) EXPECT_EQ(c->phase, detail::Phase::CLOSED);
}

// From inside each callback, close the connection it is about (or, for an end, another one),
// or destroy the backend: nothing nests, every connection ends once, nothing runs after the
// destruction began.
TEST_P(Engine, ClosingOrDestroyingFromInsideEveryCallbackIsSafe) {
  std::uint16_t port = 0;
  for (const bool destroy : {false, true}) {
    for (const Kind trigger : {Kind::ESTABLISHED, Kind::DATA, Kind::COMPLETED, Kind::READY,
                               Kind::CLOSED, Kind::REFUSED}) {
      SCOPED_TRACE(fmt::format("{} from inside callback {}", destroy ? "destroy" : "close",
                               static_cast<int>(trigger)));
      make();
      // Addresses of their own: the recorder keeps the events of every round.
      const EndPointAddress a{"10.0.1.1", ++port};
      const EndPointAddress b{"10.0.1.1", ++port};
      const EndPointAddress refused{"10.0.1.1", ++port};
      std::atomic<bool> fired{false};
      std::atomic<bool> destroyed{false};
      std::atomic<int> after{0};
      action = [&](const Recorder::Event& e) {
        if (destroyed.load()) after.fetch_add(1);
        if (e.kind != trigger || fired.exchange(true)) return;
        if (destroy) {
          destroyed.store(true);
          backend.reset();  // the facade's destructor, on the loop thread
        } else if (e.kind == Kind::CLOSED || e.kind == Kind::REFUSED || e.kind == Kind::DATA) {
          backend->close_active_endpoint(b);
        } else {
          backend->close_active_endpoint(e.remote);
        }
      };
      api([&] {
        backend->open_active_endpoint(a, params());
        backend->open_active_endpoint(b, params());
        backend->open_active_endpoint(refused, params());
      });
      const auto ca = conn(a);
      const auto cb = conn(b);
      const auto cr = conn(refused);
      std::vector<std::uint64_t> sent_a;
      on_loop([&] {
        fake->establish(ca);
        if (fake->destroyed()) return;
        fake->establish(cb);
        if (fake->destroyed()) return;
        const std::array<std::uint8_t, 3> bytes{1, 2, 3};
        fake->receive(ca, bytes);
      });
      api([&] {
        if (!backend) return;
        try {
          // One more than the window: the last is refused, the first completion ends
          // that episode (READY).
          for (std::uint64_t key = 1; key <= FakeTransport::WINDOW + 1; ++key) {
            if (send(a, key) == NetioStatus::OK) sent_a.push_back(key);
          }
        } catch (const UnknownActiveEndpoint&) {
          // closed from inside a callback already
        }
      });
      on_loop([&] { fake->complete_one(ca); });
      settle();  // the ready callback is posted
      on_loop([&] {
        if (!backend || fake->destroyed()) return;
        fake->fails(cr, "refused by the peer");
        if (fake->destroyed()) return;
        fake->peer_closes(ca);
        while (fake->complete_one(ca)) {
        }
        if (fake->destroyed()) return;
        fake->peer_closes(cb);
      });
      settle();
      EXPECT_TRUE(fired.load());
      EXPECT_EQ(after.load(), 0) << "a callback ran after the destruction had begun";
      action = nullptr;
      if (destroy) {
        EXPECT_EQ(backend, nullptr);
        continue;
      }
      for (const auto& remote : {a, b}) {
        ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, remote) == 1; }))
            << remote;
      }
      expect_keys_end_once(a, sent_a);
      EXPECT_TRUE(
          rec.wait([&](const Recorder& r) { return r.count(Kind::REFUSED, refused) == 1; }));
    }
  }
}

// Sender threads and the loop race: sends are accepted while completions arrive and the
// connection closes (locally, by the peer, or on an error) at a random moment. Every key that
// was accepted ends exactly once, none after the close. SAFE only (other threads send).
TEST_P(Engine, CompletionsRacingACloseEndEveryKeyExactlyOnce) {
  if (GetParam() == ThreadSafetyModel::UNSAFE) GTEST_SKIP() << "needs senders on other threads";
  std::mt19937 rng{20261124};
  for (int round = 0; round < 60; ++round) {
    SCOPED_TRACE(fmt::format("round {}", round));
    const EndPointAddress remote{"10.0.2.1", static_cast<std::uint16_t>(100 + round)};
    const auto c = open(remote);
    std::atomic<bool> stop{false};
    std::mutex keys_mutex;
    std::vector<std::uint64_t> accepted;
    std::atomic<std::uint64_t> next_key{1};
    std::vector<std::thread> senders;
    for (int t = 0; t < 2; ++t) {
      senders.emplace_back([&] {
        while (!stop.load()) {
          const std::uint64_t key = next_key.fetch_add(1);
          try {
            // Recorded under the lock around the call: a key is in `accepted` before its
            // completion can be checked.
            const std::lock_guard lock{keys_mutex};
            if (send(remote, key) == NetioStatus::OK) accepted.push_back(key);
          } catch (const UnknownActiveEndpoint&) {
            return;
          }
          std::this_thread::yield();
        }
      });
    }
    const int steps = static_cast<int>(rng() % 40);
    const int how = static_cast<int>(rng() % 3);
    for (int i = 0; i < steps; ++i) on_loop([&] { fake->complete_one(c); });
    if (how == 0) {
      api([&] { backend->close_active_endpoint(remote); });
    } else {
      on_loop([&] {
        if (how == 1) {
          fake->peer_closes(c);
        } else {
          fake->fails(c, "link down");
        }
      });
    }
    // What is still in flight completes (a graceful close waits for it).
    for (int i = 0; i < 100 && c->phase != detail::Phase::CLOSED; ++i) {
      on_loop([&] { fake->complete_one(c); });
    }
    stop.store(true);
    for (auto& s : senders) s.join();
    ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, remote) == 1; }));
    const std::lock_guard lock{keys_mutex};
    expect_keys_end_once(remote, accepted);
  }
}

TEST_P(Engine, SetUpMustEndWithinTheConnectTimeout) {
  make([](NetworkConfig& config) { config.limits.connect_timeout = 300ms; });
  LogCapture log;
  EndPointAddress listen;
  api([&] { listen = backend->open_listen_endpoint({"127.0.0.1", 0}, params()); });
  const EndPointAddress slow{"10.0.3.1", 1};
  const EndPointAddress quick{"10.0.3.1", 2};
  const auto started = std::chrono::steady_clock::now();
  api([&] {
    backend->open_active_endpoint(slow, params());
    backend->open_active_endpoint(quick, params());
  });
  std::shared_ptr<FakeConnection> incoming;
  on_loop([&] {
    fake->establish(fake->find(quick));
    incoming = fake->accept(listen, {"10.0.3.2", 9});
  });
  ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::REFUSED, slow) == 1; }));
  const auto waited = std::chrono::steady_clock::now() - started;
  EXPECT_GE(waited, 300ms);
  EXPECT_TRUE(log.wait("connection set-up timed out after 300 ms", 2));
  // The accepted one expired without a callback; the open one is untouched.
  EXPECT_TRUE(eventually(
      [&] {
        bool closed = false;
        on_loop([&] { closed = incoming->phase == detail::Phase::CLOSED; });
        return closed;
      },
      5s));
  settle();
  EXPECT_EQ(rec.count_now(Kind::CLOSED), 0U);
  EXPECT_EQ(conn(quick)->phase, detail::Phase::OPEN);
}

// limits.peer_timeout (common/liveness.hpp): a peer with heartbeats from which nothing arrives
// is closed (its keys cancelled once); one that keeps sending, one without heartbeats and one
// the transport is not reading are not; heartbeats go out every period to those that take them.
TEST_P(Engine, APeerThatFallsSilentIsClosedAfterThePeerTimeout) {
  constexpr auto TIMEOUT = 500ms;
  const auto period = detail::heartbeat_period(TIMEOUT);
  make([&](NetworkConfig& config) { config.limits.peer_timeout = TIMEOUT; });
  LogCapture log;
  const EndPointAddress silent{"10.0.5.1", 1};
  const EndPointAddress talking{"10.0.5.1", 2};
  const EndPointAddress old{"10.0.5.1", 3};
  const EndPointAddress unread{"10.0.5.1", 4};
  api([&] {
    for (const auto& to : {silent, talking, old, unread})
      backend->open_active_endpoint(to, params());
  });
  std::map<EndPointAddress, std::shared_ptr<FakeConnection>> c;
  const auto started = std::chrono::steady_clock::now();
  on_loop([&] {
    for (const auto& to : {silent, talking, old, unread}) {
      c[to] = fake->find(to);
      fake->connected(c[to]);
      fake->establish(c[to], to != old);
    }
    c[unread]->reading = false;
  });
  api([&] { ASSERT_EQ(send(silent, 1), NetioStatus::OK); });
  // Something arrives from `talking` four times a timeout.
  auto talk = loop.loop()->create_timer([&] { ++c[talking]->arrivals; });
  talk.start(TIMEOUT / 4);
  ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, silent) == 1; }));
  const auto waited = std::chrono::steady_clock::now() - started;
  EXPECT_GE(waited, TIMEOUT);
  EXPECT_LT(waited, TIMEOUT + 3 * period + 1s);  // a loaded machine: generous
  expect_keys_end_once(silent, {1});
  EXPECT_TRUE(log.wait("nothing arrived from the peer for 500 ms (limits.peer_timeout)", 1));
  // Three more timeouts: nobody else is closed, heartbeats keep going out.
  int before = 0;
  on_loop([&] { before = c[talking]->heartbeats_sent; });
  EXPECT_TRUE(eventually(
      [&] {
        int sent = 0;
        on_loop([&] { sent = c[talking]->heartbeats_sent; });
        return sent >= before + 3 * detail::HEARTBEATS_PER_TIMEOUT;
      },
      10s));
  on_loop([&] {
    talk.close();
    EXPECT_GE(c[silent]->heartbeats_sent, detail::HEARTBEATS_PER_TIMEOUT - 1);
    EXPECT_EQ(c[old]->heartbeats_sent, 0);
    EXPECT_GT(c[unread]->heartbeats_sent, 0);
    for (const auto& to : {talking, old, unread}) EXPECT_EQ(c[to]->phase, detail::Phase::OPEN);
  });
  EXPECT_EQ(rec.count_now(Kind::CLOSED), 1U);
}

TEST_P(Engine, DestructionAbandonsEverythingWithoutACallback) {
  EndPointAddress listen;
  api([&] { listen = backend->open_listen_endpoint({"127.0.0.1", 0}, params()); });
  const auto open_one = open(peer);
  std::shared_ptr<FakeConnection> setting_up;
  std::shared_ptr<FakeConnection> closing;
  api([&] {
    backend->open_active_endpoint({"10.0.4.1", 1}, params());
    ASSERT_EQ(send(peer, 1), NetioStatus::OK);
  });
  on_loop([&] {
    setting_up = fake->find({"10.0.4.1", 1});
    closing = fake->accept(listen, {"10.0.4.2", 2});
    fake->establish(closing);
  });
  // A graceful close waiting for its send.
  api([&] {
    ASSERT_EQ(send({"10.0.4.2", 2}, 7), NetioStatus::OK);
    backend->close_active_endpoint({"10.0.4.2", 2});
  });
  const auto before = rec.snapshot().size();
  backend.reset();
  settle();
  EXPECT_EQ(rec.snapshot().size(), before);
  for (const auto& c : {open_one, setting_up, closing}) {
    EXPECT_TRUE(c->abandoned);
    EXPECT_TRUE(c->ledger.closed());
  }
}

// ---- on_ready_to_send_cb ----------------------------------------------------------------

TEST_P(Engine, TheReadyCallbackEndsEachRefusalEpisodeOnceAtTheNextCompletion) {
  const auto c = open(peer);
  std::uint64_t key = 0;
  api([&] {
    for (std::size_t i = 0; i < FakeTransport::WINDOW; ++i)
      ASSERT_EQ(send(peer, ++key), NetioStatus::OK);
    // Two refusals: one episode.
    EXPECT_EQ(send(peer, 100), NetioStatus::NO_RESOURCES);
    EXPECT_EQ(send(peer, 101), NetioStatus::NO_RESOURCES);
  });
  settle();
  EXPECT_EQ(rec.count_now(Kind::READY), 0U) << "ready while the window is still full";
  on_loop([&] { fake->complete_one(c); });
  // Posted: it comes after the completion that freed the room, from the loop.
  ASSERT_TRUE(rec.wait([](const Recorder& r) { return r.count(Kind::READY) == 1; }));
  const auto events = rec.snapshot();
  EXPECT_EQ(events.back().kind, Kind::READY);
  EXPECT_EQ(events[events.size() - 2].kind, Kind::COMPLETED);
  on_loop([&] {
    while (fake->complete_one(c)) {
    }
  });
  settle();
  EXPECT_EQ(rec.count_now(Kind::READY), 1U) << "one callback per episode, not per completion";
  // The next refusal is the next episode.
  api([&] {
    for (std::size_t i = 0; i < FakeTransport::WINDOW; ++i)
      ASSERT_EQ(send(peer, ++key), NetioStatus::OK);
    EXPECT_EQ(send(peer, 102), NetioStatus::NO_RESOURCES);
  });
  on_loop([&] { fake->complete_one(c); });
  EXPECT_TRUE(rec.wait([](const Recorder& r) { return r.count(Kind::READY) == 2; }));
}

// The refusal and the completion that ends it race: the transport refused, and by the time
// the engine marks the episode nothing is in flight any more (here: the fake refuses once
// with an empty window, as a transport's transient "try again" would). No completion will
// come; the episode ends from the loop, after the call.
TEST_P(Engine, ARefusalWithNothingInFlightEndsFromTheLoopAfterTheCall) {
  const auto c = open(peer);
  api([&] {
    fake->refuse_next();
    EXPECT_EQ(send(peer, 1), NetioStatus::NO_RESOURCES);
  });
  ASSERT_TRUE(rec.wait([](const Recorder& r) { return r.count(Kind::READY) == 1; }));
  api([&] { EXPECT_EQ(send(peer, 2), NetioStatus::OK); });
  on_loop([&] { fake->complete_one(c); });
  settle();
  EXPECT_EQ(rec.count_now(Kind::READY), 1U);
}

TEST_P(Engine, ARefusalWhileSettingUpEndsWhenTheConnectionIsEstablished) {
  api([&] { backend->open_active_endpoint(peer, params()); });
  const auto c = conn(peer);
  api([&] { EXPECT_EQ(send(peer, 1), NetioStatus::NO_RESOURCES); });
  settle();
  EXPECT_EQ(rec.count_now(Kind::READY), 0U);
  on_loop([&] {
    fake->connected(c);
    fake->establish(c);
  });
  const auto events = rec.snapshot();
  ASSERT_GE(events.size(), 2U);
  EXPECT_EQ(events[events.size() - 2].kind, Kind::ESTABLISHED);
  EXPECT_EQ(events.back().kind, Kind::READY);
}

TEST_P(Engine, NoReadyCallbackForAConnectionThatIsClosing) {
  const auto c = open(peer);
  std::vector<std::uint64_t> keys;
  api([&] {
    for (std::uint64_t key = 1; key <= FakeTransport::WINDOW; ++key) {
      ASSERT_EQ(send(peer, key), NetioStatus::OK);
      keys.push_back(key);
    }
    EXPECT_EQ(send(peer, 99), NetioStatus::NO_RESOURCES);
    backend->close_active_endpoint(peer);  // graceful: waits for the flight
  });
  on_loop([&] {
    while (fake->complete_one(c)) {
    }
  });
  ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED, peer) == 1; }));
  settle();
  EXPECT_EQ(rec.count_now(Kind::READY), 0U);
  expect_keys_end_once(peer, keys);
}

// get_buffer's nullptr begins an episode too; with shared send buffers, a buffer that
// another connection's completion gives back ends it.
TEST_P(Engine, AnEmptySharedPoolEndsItsWaitersEpisodesWhenABufferComesBack) {
  make([](NetworkConfig& config) {
    config.shared_send_buffers = {.use_shared_send_buffers = true, .buf_size = 64, .num_buf = 2};
  });
  const EndPointAddress other{"10.0.0.2", 5000};
  const auto a = open(peer);
  open(other);
  api([&] {
    for (int i = 0; i < 2; ++i) {
      NetworkBuffer* buffer = backend->get_buffer(peer);
      ASSERT_NE(buffer, nullptr);
      ASSERT_EQ(backend->send_buffer(peer, buffer), NetioStatus::OK);
    }
    EXPECT_EQ(backend->get_buffer(other), nullptr);
  });
  settle();
  EXPECT_EQ(rec.count_now(Kind::READY), 0U);
  on_loop([&] { fake->complete_one(a); });
  ASSERT_TRUE(rec.wait([](const Recorder& r) { return r.count(Kind::READY) == 1; }));
  EXPECT_EQ(rec.snapshot().back().remote, other) << "the waiter, not the connection that sent";
  on_loop([&] { fake->complete_one(a); });
  settle();
  EXPECT_EQ(rec.count_now(Kind::READY), 1U);
  // A waiter whose pool is given back by a closing connection's cancelled sends.
  api([&] {
    NetworkBuffer* one = backend->get_buffer(peer);
    NetworkBuffer* two = backend->get_buffer(peer);
    ASSERT_NE(one, nullptr);
    ASSERT_NE(two, nullptr);
    ASSERT_EQ(backend->send_buffer(peer, one), NetioStatus::OK);
    ASSERT_EQ(backend->send_buffer(peer, two), NetioStatus::OK);
    EXPECT_EQ(backend->get_buffer(other), nullptr);
  });
  on_loop([&] { fake->fails(a, "broken"); });  // cancels both sends
  ASSERT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::READY, other) == 2; }));
}

std::string model_name(const testing::TestParamInfo<ThreadSafetyModel>& param) {
  return std::string{netio3::to_string(param.param)};
}

// Delivery acknowledgement, the receiving side: one acknowledgement per round of the loop with
// the latest count, and the last count sent by the application's close before the transport
// closes.
TEST_P(Engine, AcknowledgementsGoOncePerRoundAndBeforeALocalClose) {
  api([&] { backend->open_listen_endpoint({"0.0.0.0", 7000}, params()); });
  std::shared_ptr<FakeConnection> c;
  on_loop([&] {
    c = fake->accept({"0.0.0.0", 7000}, peer);
    c->acks.peer_wants_acks = true;  // the peer's set-up asked
    fake->establish(c);
  });
  const std::array<std::uint8_t, 3> bytes{1, 2, 3};
  on_loop([&] {
    for (int i = 0; i < 5; ++i) fake->receive(c, bytes);
  });
  settle();
  on_loop([&] { EXPECT_EQ(c->acks_sent, std::vector<std::uint64_t>{5}); });
  on_loop([&] {
    fake->receive(c, bytes);
    fake->receive(c, bytes);
    backend->close_active_endpoint(peer);  // not acknowledged: closes at once
    EXPECT_EQ(c->acks_sent, (std::vector<std::uint64_t>{5, 7}))
        << "the last count, before the close";
  });
  settle();
  on_loop([&] { EXPECT_EQ(c->acks_sent, (std::vector<std::uint64_t>{5, 7})) << "sent once"; });
}

// Large messages are acknowledged at once (the sender's buffers wait for it), not at the end
// of the round.
TEST_P(Engine, LargeDeliveriesAreAcknowledgedAtOnce) {
  api([&] { backend->open_listen_endpoint({"0.0.0.0", 7000}, params()); });
  std::shared_ptr<FakeConnection> c;
  on_loop([&] {
    c = fake->accept({"0.0.0.0", 7000}, peer);
    c->acks.peer_wants_acks = true;
    fake->establish(c);
  });
  const std::vector<std::uint8_t> large(std::size_t{256} << 10U);
  const std::array<std::uint8_t, 3> small{1, 2, 3};
  on_loop([&] {
    fake->receive(c, small);
    EXPECT_TRUE(c->acks_sent.empty()) << "a small message waits for the end of the round";
    fake->receive(c, large);
    EXPECT_EQ(c->acks_sent, std::vector<std::uint64_t>{2}) << "256 KiB: at once";
    fake->receive(c, small);
  });
  settle();
  on_loop([&] { EXPECT_EQ(c->acks_sent, (std::vector<std::uint64_t>{2, 3})); });
}

// The sending side: a send ends when the transport completed it and the peer acknowledged it;
// a count past what was sent closes the connection as a protocol error with every key not
// acknowledged listed.
TEST_P(Engine, AcknowledgedSendsEndOnTheCountAndACountPastThemIsAProtocolError) {
  auto acked = params();
  acked.delivery.acknowledged = true;
  api([&] { backend->open_active_endpoint(peer, acked); });
  auto c = conn(peer);
  on_loop([&] {
    fake->connected(c);
    fake->establish(c);
  });
  std::vector<std::uint64_t> keys;
  api([&] {
    for (std::uint64_t k = 1; k <= 3; ++k) {
      ASSERT_EQ(send(peer, k), NetioStatus::OK);
      keys.push_back(k);
    }
  });
  on_loop([&] {
    while (fake->complete_one(c)) {
    }
  });
  settle();
  EXPECT_EQ(rec.count_now(Kind::COMPLETED), 0U) << "completed before the acknowledgement";
  on_loop([&] { EXPECT_TRUE(fake->peer_acknowledges(c, 1)); });
  settle();
  EXPECT_EQ(rec.count_now(Kind::COMPLETED), 1U);
  on_loop([&] { EXPECT_FALSE(fake->peer_acknowledges(c, 4)) << "4 acknowledged, 3 sent"; });
  ASSERT_TRUE(rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  for (const auto& e : rec.snapshot()) {
    if (e.kind == Kind::CLOSED) {
      EXPECT_EQ(e.keys, (std::vector<std::uint64_t>{2, 3}));
    }
  }
  expect_keys_end_once(peer, keys);
}

INSTANTIATE_TEST_SUITE_P(Unit, Engine,
                         testing::Values(ThreadSafetyModel::SAFE, ThreadSafetyModel::UNSAFE),
                         model_name);

}  // namespace
}  // namespace netio3::test
