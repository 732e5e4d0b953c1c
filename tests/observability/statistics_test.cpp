// Statistics (netio3/statistics.hpp) on every backend, SAFE and UNSAFE: after checked
// traffic in both directions, the counters at both ends equal what the test counted - the
// send calls' results, the bytes of the messages, what the callbacks reported - exactly;
// the backend's totals keep them after the connection closed. Snapshots are taken from the
// test thread while the loop runs (UNSAFE: the backend reads them on its loop).

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
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
using Kind = Recorder::Kind;

constexpr std::size_t BUF_SIZE = 4096;
constexpr std::size_t NUM_BUF = 16;

ConnectionParameters params() {
  return ConnectionParameters{.recv_params = {.buf_size = BUF_SIZE, .num_buf = 64},
                              .send_buffered_params = {.buf_size = BUF_SIZE, .num_buf = NUM_BUF}};
}

// What one side's sender saw.
struct Sent {
  std::uint64_t ok{0};
  std::uint64_t no_resources{0};
  std::uint64_t failed{0};
  std::uint64_t bytes{0};
};

class Statistics : public ::testing::TestWithParam<BackendCase> {
 protected:
  void SetUp() override {
    server =
        Netio3Backend::create(GetParam().type, server_rec.config(GetParam().model), loop.loop());
    client =
        Netio3Backend::create(GetParam().type, client_rec.config(GetParam().model), loop.loop());
    api([&] { listen = server->open_listen_endpoint({"127.0.0.1", 0}, params()); });
    api([&] { client->open_active_endpoint(listen, params()); });
    ASSERT_TRUE(client_rec.wait([](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
    ASSERT_TRUE(server_rec.wait([](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
    for (const auto& e : server_rec.snapshot()) {
      if (e.kind == Kind::ESTABLISHED) from_client = e.remote;
    }
  }

  void TearDown() override {
    client.reset();
    server.reset();
  }

  // Runs the API call as the thread-safety model allows (UNSAFE: on the loop thread).
  void api(const std::function<void()>& f) {
    if (GetParam().model == ThreadSafetyModel::UNSAFE) {
      loop.loop()->run_sync(f);
    } else {
      f();
    }
  }

  // Sends `count` buffered messages of varying sizes from `backend` to `to`; a buffer
  // refused with NO_RESOURCES is sent again (the caller keeps it) after a completion, as is
  // get_buffer's nullptr; then `failures` sends that must fail (a null buffer). Counts what
  // the calls returned.
  Sent send(NetworkBackend& backend, Recorder& rec, const EndPointAddress& to, std::uint64_t count,
            int failures) {
    Sent sent;
    NetworkBuffer* buffer = nullptr;  // filled with message `i`, not accepted yet
    for (std::uint64_t i = 0; i < count;) {
      const std::size_t size = 1 + (i * 37) % (BUF_SIZE - 1);
      // Completions so far, read before the attempt: one that comes after it wakes the wait.
      const auto done = rec.count_now(Kind::COMPLETED);
      NetioStatus status = NetioStatus::FAILED;
      api([&] {
        if (buffer == nullptr) {
          buffer = backend.get_buffer(to);
          if (buffer == nullptr) return;
          const auto bytes = pattern(i, size);
          buffer->write(std::span<const std::uint8_t>{bytes});
        }
        status = backend.send_buffer(to, buffer);
      });
      if (buffer == nullptr || status == NetioStatus::NO_RESOURCES) {
        if (buffer != nullptr) ++sent.no_resources;
        EXPECT_TRUE(rec.wait([&](const Recorder& r) { return r.count(Kind::COMPLETED) > done; }));
        continue;
      }
      EXPECT_EQ(status, NetioStatus::OK);
      buffer = nullptr;
      ++sent.ok;
      sent.bytes += size;
      ++i;
    }
    for (int f = 0; f < failures; ++f) {
      api([&] { EXPECT_EQ(backend.send_buffer(to, nullptr), NetioStatus::FAILED); });
      ++sent.failed;
    }
    return sent;
  }

  // The test's view of a connection's counters against the backend's.
  static void expect_counts(const ConnectionStatistics& s, const Sent& sent, std::uint64_t received,
                            std::uint64_t received_bytes) {
    EXPECT_EQ(s.sends_accepted, sent.ok);
    EXPECT_EQ(s.sends_completed, sent.ok);
    EXPECT_EQ(s.sends_cancelled, 0U);
    EXPECT_EQ(s.sends_no_resources, sent.no_resources);
    EXPECT_EQ(s.sends_failed, sent.failed);
    EXPECT_EQ(s.bytes_sent, sent.bytes);
    EXPECT_EQ(s.keys_in_flight, 0U);
    EXPECT_EQ(s.bytes_queued, 0U);
    EXPECT_EQ(s.messages_received, received);
    EXPECT_EQ(s.bytes_received, received_bytes);
    EXPECT_GE(s.send_buffers_high_water, 1U);
    EXPECT_LE(s.send_buffers_high_water, NUM_BUF);
  }

  Recorder server_rec;
  Recorder client_rec;
  LoopThread loop;
  std::unique_ptr<NetworkBackend> server;
  std::unique_ptr<NetworkBackend> client;
  EndPointAddress listen;
  EndPointAddress from_client;  // the client as the server addresses it
};

TEST_P(Statistics, CountersAtBothEndsEqualWhatWasSentReceivedAndReported) {
  constexpr std::uint64_t TO_SERVER = 3000;
  constexpr std::uint64_t TO_CLIENT = 1000;
  const Sent up = send(*client, client_rec, listen, TO_SERVER, 3);
  const Sent down = send(*server, server_rec, from_client, TO_CLIENT, 2);
  ASSERT_TRUE(client_rec.wait([&](const Recorder& r) {
    return r.count(Kind::COMPLETED) == up.ok && r.count(Kind::DATA) == TO_CLIENT;
  }));
  ASSERT_TRUE(server_rec.wait([&](const Recorder& r) {
    return r.count(Kind::COMPLETED) == down.ok && r.count(Kind::DATA) == TO_SERVER;
  }));
  // What the callbacks reported is what was sent.
  EXPECT_EQ(server_rec.bytes_received(), up.bytes);
  EXPECT_EQ(client_rec.bytes_received(), down.bytes);

  const auto at_client = client->statistics(listen);
  const auto at_server = server->statistics(from_client);
  {
    SCOPED_TRACE("client");
    EXPECT_TRUE(at_client.open);
    EXPECT_GT(at_client.age.count(), 0);
    expect_counts(at_client, up, TO_CLIENT, down.bytes);
  }
  {
    SCOPED_TRACE("server");
    EXPECT_TRUE(at_server.open);
    expect_counts(at_server, down, TO_SERVER, up.bytes);
  }
  const auto all = server->connection_statistics();
  ASSERT_EQ(all.size(), 1U);
  EXPECT_EQ(all[0].remote, from_client);
  EXPECT_EQ(all[0].messages_received, TO_SERVER);
  EXPECT_THROW((void)client->statistics({"127.0.0.1", 1}), UnknownActiveEndpoint);

  // Closed: the connection is gone, the backend's totals keep its counts.
  api([&] { client->close_active_endpoint(listen); });
  ASSERT_TRUE(client_rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  ASSERT_TRUE(server_rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  const auto total = client->backend_statistics();
  EXPECT_EQ(total.connections_open, 0U);
  EXPECT_EQ(total.connections_set_up, 0U);
  EXPECT_EQ(total.connections_closed, 1U);
  EXPECT_EQ(total.sends_accepted, up.ok);
  EXPECT_EQ(total.sends_completed, up.ok);
  EXPECT_EQ(total.sends_failed, up.failed);
  EXPECT_EQ(total.sends_no_resources, up.no_resources);
  EXPECT_EQ(total.bytes_sent, up.bytes);
  EXPECT_EQ(total.messages_received, TO_CLIENT);
  EXPECT_EQ(total.bytes_received, down.bytes);
  EXPECT_TRUE(client->connection_statistics().empty());
  const auto server_total = server->backend_statistics();
  EXPECT_EQ(server_total.connections_closed, 1U);
  EXPECT_EQ(server_total.messages_received, TO_SERVER);
  EXPECT_EQ(server_total.bytes_sent, down.bytes);
}

INSTANTIATE_TEST_SUITE_P(Backends, Statistics, ::testing::ValuesIn(backend_cases()),
                         [](const auto& param_info) { return backend_case_name(param_info); });

}  // namespace
}  // namespace netio3::test
