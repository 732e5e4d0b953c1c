// Data path conformance: backend x send mode x thread-safety model x message size, and the
// extreme sizes once more with the client's sends acknowledged (DeliveryParameters), and on
// asyncmsg with a session (delivery.session).

#include <algorithm>
#include <set>
#include <thread>

#include "conformance.hpp"

namespace netio3::conformance {
namespace {

struct DataParam {
  BackendType backend;
  SendMode mode;
  ThreadSafetyModel model;
  std::size_t size;
  bool acknowledged{false};
  bool session{false};
};

std::string size_name(std::size_t size) {
  if (size == BUF_SIZE) return "bufsize";
  if (size == LARGE) return "large";
  return "size" + std::to_string(size);
}

std::string param_name(const testing::TestParamInfo<DataParam>& info) {
  const auto& p = info.param;
  return fmt::format("{}_{}_{}_{}{}", netio3::to_string(p.backend), to_string(p.mode),
                     netio3::to_string(p.model), size_name(p.size),
                     p.session        ? "_session"
                     : p.acknowledged ? "_acknowledged"
                                      : "");
}

std::vector<DataParam> all_params() {
  std::vector<DataParam> out;
  for (const auto backend : backends()) {
    for (const auto mode : {SendMode::BUFFERED, SendMode::ZERO_COPY, SendMode::COPY}) {
      for (const auto model : {ThreadSafetyModel::SAFE, ThreadSafetyModel::UNSAFE}) {
        for (const std::size_t size :
             {std::size_t{0}, std::size_t{1}, std::size_t{64}, BUF_SIZE, LARGE}) {
          out.push_back({backend, mode, model, size});
        }
        for (const std::size_t size : {std::size_t{0}, LARGE}) {
          out.push_back({backend, mode, model, size, true});
          if (backend == BackendType::ASYNCMSG)
            out.push_back({backend, mode, model, size, true, true});
        }
      }
    }
  }
  return out;
}

class Data : public testing::TestWithParam<DataParam> {
 protected:
  void SetUp() override {
    const auto& p = GetParam();
    const auto& t = traits(p.backend);
    if (p.mode == SendMode::COPY && !t.copy_supported) {
      GTEST_SKIP() << netio3::to_string(p.backend) << " does not support send_data_copy";
    }
    if (p.mode == SendMode::BUFFERED && p.size > BUF_SIZE) {
      GTEST_SKIP() << "a buffered message cannot exceed the send buffer size (" << BUF_SIZE << ")";
    }
    server = std::make_unique<Node>(p.backend, p.model);
    client = std::make_unique<Node>(p.backend, p.model);
    count = p.size >= LARGE ? 24 : 400;
    region.resize(std::max<std::size_t>(count * p.size, 64));
    listen = server->call([&] {
      return server->backend->open_listen_endpoint({test::test_address(), 0},
                                                   receiver_params(std::max(p.size, BUF_SIZE)));
    });
    ASSERT_NE(listen.port, 0);
    client->call([&] {
      auto params = sender_params(t, p.mode, region, BUF_SIZE, std::max(p.size, BUF_SIZE));
      params.delivery.acknowledged = p.acknowledged;
      params.delivery.session.enabled = p.session;
      client->backend->open_active_endpoint(listen, params);
    });
    auto remote = wait_connected(*client, *server, listen);
    ASSERT_TRUE(remote.has_value()) << "connection was not established on both sides";
    server_side = *remote;
  }

  void TearDown() override {
    client.reset();
    server.reset();
  }

  std::unique_ptr<Node> server;
  std::unique_ptr<Node> client;
  std::vector<std::uint8_t> region;
  std::size_t count{0};
  EndPointAddress listen;
  EndPointAddress server_side;
};

// Every message arrives once, complete, in order; every accepted send completes exactly
// once with its key; closing reports no cancelled key and reaches both sides.
TEST_P(Data, StreamArrivesIntactInOrderAndEverySendCompletesOnce) {
  const auto& p = GetParam();
  std::vector<std::uint64_t> keys;
  for (std::size_t i = 0; i < count; ++i) {
    const auto message = test::pattern(i, p.size);
    std::uint64_t key = 0;
    ASSERT_EQ(send_one(*client, listen, p.mode, message, region, i, &key), NetioStatus::OK)
        << "message " << i;
    keys.push_back(key);
  }
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) >= count; }))
      << "received " << server->rec.snapshot().size() << " events";
  ASSERT_TRUE(
      client->rec.wait([&](const Recorder& r) { return r.count(Kind::COMPLETED) >= count; }));

  const auto messages = server->rec.messages_snapshot();
  ASSERT_EQ(messages.size(), count);
  for (std::size_t i = 0; i < count; ++i) {
    ASSERT_EQ(messages[i].size(), p.size) << "message " << i;
    ASSERT_TRUE(test::matches_pattern(messages[i], i))
        << "message " << i << " corrupted or out of order";
  }

  std::multiset<std::uint64_t> completed;
  for (const auto& e : client->rec.snapshot()) {
    if (e.kind == Kind::COMPLETED) {
      EXPECT_EQ(e.remote, listen);
      completed.insert(e.key);
    }
  }
  EXPECT_EQ(completed, std::multiset<std::uint64_t>(keys.begin(), keys.end()));

  client->call([&] { client->backend->close_active_endpoint(listen); });
  ASSERT_TRUE(client->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
  for (const auto& e : client->rec.snapshot()) {
    if (e.kind == Kind::CLOSED) {
      EXPECT_EQ(e.remote, listen);
      EXPECT_TRUE(e.keys.empty()) << "nothing was outstanding, nothing may be cancelled";
    }
  }
  for (const auto& e : server->rec.snapshot()) {
    if (e.kind == Kind::CLOSED) {
      EXPECT_EQ(e.remote, server_side);
    }
  }
  // No further completion after the close, nothing more received.
  EXPECT_EQ(client->rec.count_now(Kind::COMPLETED), count);
  EXPECT_EQ(server->rec.count_now(Kind::DATA), count);
}

// Ping-pong: the server echoes each message from inside on_data_cb (buffered send on the
// loop thread), the client sends the next one only after the echo arrived.
TEST_P(Data, EchoFromInsideTheDataCallback) {
  const auto& p = GetParam();
  server->rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t> bytes) {
    if (e.kind != Kind::DATA) return;
    NetworkBuffer* buffer = server->backend->get_buffer(server_side);
    ASSERT_NE(buffer, nullptr);
    buffer->write(bytes);
    ASSERT_EQ(server->backend->send_buffer(server_side, buffer), NetioStatus::OK);
  });
  const std::size_t rounds = std::min<std::size_t>(count, 32);
  for (std::size_t i = 0; i < rounds; ++i) {
    const auto message = test::pattern(i, p.size);
    ASSERT_EQ(send_one(*client, listen, p.mode, message, region, i), NetioStatus::OK);
    ASSERT_TRUE(client->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == i + 1; }))
        << "echo " << i << " did not arrive";
  }
  const auto echoes = client->rec.messages_snapshot();
  ASSERT_EQ(echoes.size(), rounds);
  for (std::size_t i = 0; i < rounds; ++i) {
    EXPECT_EQ(echoes[i], test::pattern(i, p.size)) << "echo " << i;
  }
  ASSERT_TRUE(
      server->rec.wait([&](const Recorder& r) { return r.count(Kind::COMPLETED) == rounds; }));
}

// Every callback runs on the loop thread.
TEST_P(Data, CallbacksRunOnTheLoopThread) {
  const auto& p = GetParam();
  for (std::size_t i = 0; i < 8; ++i) {
    ASSERT_EQ(send_one(*client, listen, p.mode, test::pattern(i, p.size), region, i),
              NetioStatus::OK);
  }
  ASSERT_TRUE(client->rec.wait([&](const Recorder& r) { return r.count(Kind::COMPLETED) == 8; }));
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == 8; }));
  std::thread::id client_loop;
  std::thread::id server_loop;
  client->loop.loop()->run_sync([&] { client_loop = std::this_thread::get_id(); });
  server->loop.loop()->run_sync([&] { server_loop = std::this_thread::get_id(); });
  ASSERT_NE(client_loop, std::this_thread::get_id()) << "run_sync must have run on the loop thread";
  for (const auto& e : client->rec.snapshot()) EXPECT_EQ(e.thread, client_loop);
  for (const auto& e : server->rec.snapshot()) EXPECT_EQ(e.thread, server_loop);
}

INSTANTIATE_TEST_SUITE_P(Conformance, Data, testing::ValuesIn(all_params()), param_name);

}  // namespace
}  // namespace netio3::conformance
