// UCX-specific behaviour. The conformance suite covers everything common.

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <sys/resource.h>
#include <vector>

#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "test_support.hpp"

namespace netio3::test {
namespace {

// UCX 1.13 allows UCX_ASYNC_MAX_EVENTS (default 1024) handlers on its async thread per
// process, one per listener and one per connection-manager endpoint; at that limit an
// incoming connection request crashes UCX's async thread. The backend raises the limit to
// RLIMIT_NOFILE. Listeners are the handlers that can be counted without connections (a
// listener beyond UCX's limit fails cleanly with "User-defined limit was reached"), so the
// test opens more listeners than UCX's default allows, then connects to the last one.
TEST(UcxLimits, MoreAsyncHandlersThanUcxsDefaultAllow) {
  constexpr std::size_t LISTENERS = 1100;
  if (const char* env = std::getenv("UCX_ASYNC_MAX_EVENTS"); env != nullptr && *env != '\0') {
    GTEST_SKIP() << "UCX_ASYNC_MAX_EVENTS is set (" << env << "): UCX's limit is the user's";
  }
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  constexpr rlim_t WANT = 4096;
  if (limit.rlim_cur < WANT) {
    limit.rlim_cur = std::min(WANT, limit.rlim_max);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &limit), 0);
  }
  if (limit.rlim_cur < 2 * LISTENERS) {
    GTEST_SKIP() << "RLIMIT_NOFILE is " << limit.rlim_cur << " (hard " << limit.rlim_max
                 << "): too few descriptors for " << LISTENERS << " listeners";
  }
  Recorder server_rec;
  Recorder client_rec;
  LoopThread loop;
  auto server = Netio3Backend::create(
      BackendType::UCX, server_rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP), loop.loop());
  auto client = Netio3Backend::create(
      BackendType::UCX, client_rec.config(ThreadSafetyModel::SAFE, NetworkMode::TCP), loop.loop());
  std::vector<EndPointAddress> listeners;
  for (std::size_t i = 0; i < LISTENERS; ++i) {
    try {
      listeners.push_back(server->open_listen_endpoint(
          {"127.0.0.1", 0}, {.recv_params = {.buf_size = 64, .num_buf = 2}}));
    } catch (const FailedOpenListenEndpoint& e) {
      FAIL() << "listener " << i + 1 << " of " << LISTENERS << ": " << e.what();
    }
  }
  client->open_active_endpoint(listeners.back(),
                               {.send_buffered_params = {.buf_size = 64, .num_buf = 2}});
  ASSERT_TRUE(
      client_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
  auto* buffer = client->get_buffer(listeners.back());
  ASSERT_NE(buffer, nullptr);
  buffer->write(std::uint32_t{0x0C5});
  ASSERT_EQ(client->send_buffer(listeners.back(), buffer), NetioStatus::OK);
  ASSERT_TRUE(
      server_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::DATA) == 1; }));
  std::cout << "[ limits   ] " << LISTENERS << " listeners and a connection in one process, "
            << "RLIMIT_NOFILE " << limit.rlim_cur << "\n";
  client.reset();
  server.reset();
}

}  // namespace
}  // namespace netio3::test
