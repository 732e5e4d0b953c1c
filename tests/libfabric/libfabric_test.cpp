// libfabric-specific behaviour: provider choice, FI_PROVIDER, and providers whose wait
// objects netio3 cannot sleep on. The conformance suite covers everything common.

#include <condition_variable>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "test_support.hpp"

namespace netio3::test {
namespace {

// Sets an environment variable for one test (FI_PROVIDER is read when a backend is made).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : m_name{name} {
    if (const char* old = std::getenv(name)) m_old = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (m_old) {
      ::setenv(m_name, m_old->c_str(), 1);
    } else {
      ::unsetenv(m_name);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ScopedEnv(ScopedEnv&&) = delete;
  ScopedEnv& operator=(ScopedEnv&&) = delete;

 private:
  const char* m_name;
  std::optional<std::string> m_old;
};

// Captures log lines for one test.
class LogCapture {
 public:
  LogCapture() {
    set_log_sink([this](LogLevel, std::string_view line) {
      const std::lock_guard lock{m_mutex};
      m_lines.emplace_back(line);
    });
  }
  ~LogCapture() { set_log_sink({}); }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  LogCapture(LogCapture&&) = delete;
  LogCapture& operator=(LogCapture&&) = delete;
  [[nodiscard]] bool contains(std::string_view text) const {
    const std::lock_guard lock{m_mutex};
    for (const auto& l : m_lines) {
      if (l.find(text) != std::string::npos) return true;
    }
    return false;
  }

 private:
  mutable std::mutex m_mutex;
  std::vector<std::string> m_lines;
};

std::unique_ptr<NetworkBackend> make(Recorder& rec, LoopThread& loop, NetworkMode mode) {
  return Netio3Backend::create(BackendType::LIBFABRIC, rec.config(ThreadSafetyModel::SAFE, mode),
                               loop.loop());
}

// NetworkMode::RDMA selects verbs. Without an RDMA device the failure says which provider
// was asked for and why it is not there.
TEST(LibfabricProvider, RdmaModeAsksForVerbsAndSaysSoWhenItIsMissing) {
  const ScopedEnv no_override{"FI_PROVIDER", nullptr};
  Recorder rec;
  LoopThread loop;
  auto backend = make(rec, loop, NetworkMode::RDMA);
  try {
    const auto listen = backend->open_listen_endpoint({"127.0.0.1", 0}, {});
    GTEST_SKIP() << "a verbs device serves 127.0.0.1 here (listening on " << listen << ")";
  } catch (const FailedOpenListenEndpoint& e) {
    EXPECT_NE(std::string{e.what()}.find("'verbs'"), std::string::npos) << e.what();
    EXPECT_NE(std::string{e.what()}.find("fi_getinfo"), std::string::npos) << e.what();
  }
}

// FI_PROVIDER wins over NetworkMode: RDMA mode over the tcp provider works end to end.
TEST(LibfabricProvider, FiProviderOverridesTheMode) {
  const ScopedEnv tcp{"FI_PROVIDER", "tcp"};
  Recorder server_rec;
  Recorder client_rec;
  LoopThread loop;
  auto server = make(server_rec, loop, NetworkMode::RDMA);
  auto client = make(client_rec, loop, NetworkMode::RDMA);
  const auto listen = server->open_listen_endpoint({"127.0.0.1", 0},
                                                   {.recv_params = {.buf_size = 64, .num_buf = 4}});
  client->open_active_endpoint(listen, {.send_buffered_params = {.buf_size = 64, .num_buf = 4}});
  ASSERT_TRUE(
      client_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
  auto* buffer = client->get_buffer(listen);
  ASSERT_NE(buffer, nullptr);
  buffer->write(std::uint32_t{0xFAB});
  ASSERT_EQ(client->send_buffer(listen, buffer), NetioStatus::OK);
  ASSERT_TRUE(
      server_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::DATA) == 1; }));
  client.reset();
  server.reset();
}

// A provider whose completion queue has no pollable wait fd cannot run on the event loop:
// it is refused with the reason instead of being polled.
TEST(LibfabricProvider, ProviderWithoutAWaitFdIsRefusedWithTheReason) {
  const ScopedEnv sockets{"FI_PROVIDER", "sockets"};
  Recorder rec;
  LoopThread loop;
  auto backend = make(rec, loop, NetworkMode::TCP);
  try {
    const auto listen = backend->open_listen_endpoint({"127.0.0.1", 0}, {});
    GTEST_SKIP() << "the sockets provider here offers wait fds (listening on " << listen << ")";
  } catch (const FailedOpenListenEndpoint& e) {
    const std::string what = e.what();
    if (what.find("fi_getinfo") != std::string::npos) {
      GTEST_SKIP() << "no sockets provider here: " << what;
    }
    EXPECT_NE(what.find("FI_GETWAIT"), std::string::npos) << what;
  }
}

// Never busy in silence: with a provider whose wait objects stay readable (the 'net'
// provider of libfabric 1.17) the loop cannot sleep, and the backend says so; with one
// that works, an idle connection does not wake the loop at all.
TEST(LibfabricProvider, ALoopThatCannotSleepIsReported) {
  const ScopedEnv net{"FI_PROVIDER", "net"};
  const LogCapture logs;
  Recorder server_rec;
  Recorder client_rec;
  LoopThread loop;
  auto server = make(server_rec, loop, NetworkMode::TCP);
  auto client = make(client_rec, loop, NetworkMode::TCP);
  EndPointAddress listen;
  try {
    listen = server->open_listen_endpoint({"127.0.0.1", 0},
                                          {.recv_params = {.buf_size = 64, .num_buf = 4}});
  } catch (const FailedOpenListenEndpoint& e) {
    GTEST_SKIP() << "no usable net provider here: " << e.what();
  }
  client->open_active_endpoint(listen, {.send_buffered_params = {.buf_size = 64, .num_buf = 4}});
  ASSERT_TRUE(
      client_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
  // Let 200 ms pass on a loop timer, then look.
  std::mutex mutex;
  std::condition_variable cv;
  bool fired = false;
  const auto before = loop.loop()->wakeups();
  auto timer = loop.loop()->create_timer([&] {
    const std::lock_guard lock{mutex};
    fired = true;
    cv.notify_all();
  });
  timer.start_once(std::chrono::milliseconds{200});
  {
    std::unique_lock lock{mutex};
    ASSERT_TRUE(cv.wait_for(lock, DEFAULT_TIMEOUT, [&] { return fired; }));
  }
  const auto woke = loop.loop()->wakeups() - before;
  const bool reported = logs.contains("woke the event loop") && logs.contains("'net'");
  EXPECT_TRUE(woke <= 4 || reported) << woke << " wake-ups in 200 ms and no warning";
  std::cout << "[ net      ] " << woke << " wake-ups in 200 ms idle, warning logged: " << reported
            << "\n";
  loop.loop()->run_sync([&] { timer.close(); });
  client.reset();
  server.reset();
}

}  // namespace
}  // namespace netio3::test
