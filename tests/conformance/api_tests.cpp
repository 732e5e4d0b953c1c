// API contract conformance: the documented exceptions and statuses, per backend and
// thread-safety model.

#include <algorithm>
#include <array>
#include <condition_variable>
#include <iostream>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <gmock/gmock.h>

#include "conformance.hpp"

namespace netio3::conformance {
namespace {

struct ApiParam {
  BackendType backend;
  ThreadSafetyModel model;
};

std::string param_name(const testing::TestParamInfo<ApiParam>& info) {
  return fmt::format("{}_{}", netio3::to_string(info.param.backend),
                     netio3::to_string(info.param.model));
}

std::vector<ApiParam> all_params() {
  std::vector<ApiParam> out;
  for (const auto backend : backends()) {
    for (const auto model : {ThreadSafetyModel::SAFE, ThreadSafetyModel::UNSAFE}) {
      out.push_back({backend, model});
    }
  }
  return out;
}

class Api : public testing::TestWithParam<ApiParam> {
 protected:
  std::unique_ptr<Node> make_node(const std::function<void(NetworkConfig&)>& tweak = {}) {
    return std::make_unique<Node>(GetParam().backend, GetParam().model, tweak);
  }

  // Opens a listener on `server` and connects `client` to it with `params`; nullopt if the
  // client did not see the connection established in time.
  static std::optional<EndPointAddress> connect_to_new_listener(
      Node& server, Node& client, const ConnectionParameters& params) {
    const auto listen = server.call([&] {
      return server.backend->open_listen_endpoint({test::test_address(), 0},
                                                  receiver_params(BUF_SIZE));
    });
    client.call([&] { client.backend->open_active_endpoint(listen, params); });
    if (!client.rec.wait(
            [&](const Recorder& r) { return r.count(Kind::ESTABLISHED, listen) == 1; })) {
      return std::nullopt;
    }
    return listen;
  }
};

TEST_P(Api, ListenEndpointErrors) {
  auto node = make_node();
  auto& b = *node->backend;
  EXPECT_THROW(node->call([&] {
    return b.open_listen_endpoint({"not-an-ip", 0}, {});
  }),
               InvalidEndpointAddress);
  EXPECT_THROW(node->call([&] {
    return b.open_listen_endpoint({"", 0}, {});
  }),
               InvalidEndpointAddress);
  EXPECT_THROW(node->call([&] {
    return b.open_listen_endpoint({"300.1.2.3", 0}, {});
  }),
               InvalidEndpointAddress);
  const auto listen = node->call([&] {
    return b.open_listen_endpoint({test::test_address(), 0}, receiver_params(BUF_SIZE));
  });
  EXPECT_NE(listen.port, 0) << "port 0 must come back as the port the OS chose";
  EXPECT_EQ(listen.address, test::test_address());
  EXPECT_THROW(
      node->call([&] { return b.open_listen_endpoint(listen, receiver_params(BUF_SIZE)); }),
      ListenEndpointAlreadyExists);
  {
    // A port held by someone else.
    const test::RawListener other;
    const EndPointAddress taken = other.address();
    try {
      node->call([&] { return b.open_listen_endpoint(taken, receiver_params(BUF_SIZE)); });
      ADD_FAILURE() << "listening on a port in use must fail";
    } catch (const FailedOpenListenEndpoint& e) {
      EXPECT_NE(std::string{e.what()}.find(to_string(taken)), std::string::npos)
          << "the message names the endpoint: " << e.what();
    }
  }
  EXPECT_THROW(node->call([&] {
    b.close_listen_endpoint({"127.0.0.1", 1});
  }),
               UnknownListenEndpoint);
  EXPECT_THROW(node->call([&] { b.close_listen_endpoint({"bogus", 1}); }), InvalidEndpointAddress);
  node->call([&] { b.close_listen_endpoint(listen); });
  EXPECT_THROW(node->call([&] { b.close_listen_endpoint(listen); }), UnknownListenEndpoint);
}

TEST_P(Api, ActiveEndpointErrors) {
  auto server = make_node();
  auto node = make_node();
  auto& b = *node->backend;
  const auto listen = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0},
                                                 receiver_params(BUF_SIZE));
  });
  const ConnectionParameters buffered{
      .send_buffered_params = {.buf_size = BUF_SIZE, .num_buf = NUM_BUF}};
  EXPECT_THROW(node->call([&] {
    b.open_active_endpoint({"256.0.0.1", 1}, buffered);
  }),
               InvalidEndpointAddress);
  node->call([&] { b.open_active_endpoint(listen, buffered); });
  EXPECT_THROW(node->call([&] { b.open_active_endpoint(listen, buffered); }),
               ActiveEndpointAlreadyExists);
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));

  const EndPointAddress unknown{"127.0.0.1", 1};
  EXPECT_THROW(node->call([&] { b.close_active_endpoint(unknown); }), UnknownActiveEndpoint);
  EXPECT_THROW(node->call([&] { b.close_active_endpoint({"x.y", 1}); }), InvalidEndpointAddress);
  EXPECT_THROW(node->call([&] { return b.get_buffer(unknown); }), UnknownActiveEndpoint);
  EXPECT_THROW(node->call([&] { return b.send_buffer(unknown, nullptr); }), UnknownActiveEndpoint);
  std::vector<std::uint8_t> data(8);
  EXPECT_THROW(node->call([&] { return b.send_data(unknown, data, {}, 1); }),
               UnknownActiveEndpoint);
  EXPECT_THROW(node->call([&] {
    return b.send_data({"nope", 1}, data, {}, 1);
  }),
               InvalidEndpointAddress);
  if (node->traits.copy_supported) {
    EXPECT_THROW(node->call([&] { return b.send_data_copy(unknown, data, {}, 1); }),
                 UnknownActiveEndpoint);
  }

  // A buffer that get_buffer did not hand out is FAILED, and ours still works after.
  std::vector<std::uint8_t> storage(64);
  NetworkBuffer foreign{storage, 0};
  EXPECT_EQ(node->call([&] { return b.send_buffer(listen, &foreign); }), NetioStatus::FAILED);
  EXPECT_EQ(node->call([&] { return b.send_buffer(listen, nullptr); }), NetioStatus::FAILED);
  NetworkBuffer* mine = node->call([&] { return b.get_buffer(listen); });
  ASSERT_NE(mine, nullptr);
  mine->write(std::uint32_t{42});
  EXPECT_EQ(node->call([&] { return b.send_buffer(listen, mine); }), NetioStatus::OK);
  // The same buffer twice before it completed is not a buffer we lent out; the reason is
  // the calling thread's last_send_failure().
  SendFailure failure;
  EXPECT_EQ(node->call([&] {
    const auto status = b.send_buffer(listen, mine);
    failure = last_send_failure();
    return status;
  }),
            NetioStatus::FAILED);
  EXPECT_EQ(failure.cause, SendFailureCause::INVALID) << failure.message;
  EXPECT_THAT(failure.message, testing::HasSubstr("not a buffer handed out by get_buffer"));
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::COMPLETED) == 1; }));
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == 1; }));
  EXPECT_EQ(server->rec.messages_snapshot().at(0).size(), sizeof(std::uint32_t));

  // Header data is limited to 16 bytes.
  if (node->traits.copy_supported) {
    const std::vector<std::uint8_t> header(MAX_HEADER_SIZE + 1);
    EXPECT_EQ(node->call([&] {
      const auto status = b.send_data_copy(listen, data, header, 9);
      failure = last_send_failure();
      return status;
    }),
              NetioStatus::FAILED);
    EXPECT_EQ(failure.cause, SendFailureCause::INVALID) << failure.message;
    EXPECT_THAT(failure.message, testing::HasSubstr("header_data of 17 bytes"));
  }
}

TEST_P(Api, GetBufferWithoutBuffersThrowsNoBuffersAllocated) {
  auto server = make_node();
  auto node = make_node();
  const auto listen = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0},
                                                 receiver_params(BUF_SIZE));
  });
  std::vector<std::uint8_t> region(4096);
  node->call([&] {
    node->backend->open_active_endpoint(
        listen, {.send_zero_copy_params = {.buf_size = region.size(), .mr_start = region.data()}});
  });
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
  EXPECT_THROW(node->call([&] { return node->backend->get_buffer(listen); }), NoBuffersAllocated);
}

TEST_P(Api, GetBufferRunsDryThenRecoversAfterCompletions) {
  auto server = make_node();
  auto node = make_node();
  const auto connected = connect_to_new_listener(
      *server, *node, {.send_buffered_params = {.buf_size = 256, .num_buf = 4}});
  ASSERT_TRUE(connected.has_value());
  const EndPointAddress listen = *connected;
  std::vector<NetworkBuffer*> lent;
  for (int i = 0; i < 4; ++i) {
    lent.push_back(node->call([&] { return node->backend->get_buffer(listen); }));
    ASSERT_NE(lent.back(), nullptr);
    EXPECT_EQ(lent.back()->capacity(), 256U);
    EXPECT_EQ(lent.back()->size(), 0U);
  }
  EXPECT_EQ(node->call([&] { return node->backend->get_buffer(listen); }), nullptr);
  std::set<std::uint64_t> ids;
  for (auto* buffer : lent) {
    ids.insert(buffer->id());
    EXPECT_THROW(buffer->write(std::vector<std::uint8_t>(257)), BufferOverflow);
    EXPECT_EQ(buffer->size(), 0U) << "an overflowing write writes nothing";
    buffer->write(std::uint8_t{1});
    EXPECT_EQ(node->call([&] { return node->backend->send_buffer(listen, buffer); }),
              NetioStatus::OK);
  }
  EXPECT_EQ(ids.size(), 4U) << "four distinct buffers";
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::COMPLETED) == 4; }));
  std::set<std::uint64_t> completed;
  for (const auto& e : node->rec.snapshot()) {
    if (e.kind == Kind::COMPLETED) completed.insert(e.key);
  }
  EXPECT_EQ(completed, ids) << "the key of a buffered send is the buffer's id";
  EXPECT_NE(node->call([&] { return node->backend->get_buffer(listen); }), nullptr);
}

TEST_P(Api, InvalidConnectionParametersAreRejected) {
  auto node = make_node([](NetworkConfig& c) {
    c.shared_send_buffers = {.use_shared_send_buffers = true, .buf_size = 1024, .num_buf = 8};
  });
  auto& b = *node->backend;
  const EndPointAddress somewhere{"127.0.0.1", 9};
  EXPECT_THROW(node->call([&] {
    b.open_active_endpoint(somewhere, {.send_buffered_params = {.buf_size = 0, .num_buf = 4}});
  }),
               InvalidConnectionParameters);
  EXPECT_THROW(node->call([&] {
    b.open_active_endpoint(somewhere, {.send_buffered_params = {.buf_size = 4096, .num_buf = 4}});
  }),
               InvalidConnectionParameters)
      << "larger than the shared send buffers";
  std::uint8_t byte = 0;
  EXPECT_THROW(node->call([&] {
    b.open_active_endpoint(somewhere,
                           {.send_zero_copy_params = {.buf_size = 0, .mr_start = &byte}});
  }),
               InvalidConnectionParameters);
  EXPECT_THROW(node->call([&] {
    b.open_active_endpoint(
        somewhere,
        {.recv_params = {.buf_size = 64, .num_buf = 1, .use_shared_receive_buffers = true}});
  }),
               InvalidConnectionParameters)
      << "per-listener shared receive buffers make no sense on an active endpoint";
}

TEST_P(Api, FactoryRejectsBadConfigurationAndLists) {
  const auto loop = std::make_shared<EpollEventLoop>();
  NetworkConfig config{.mode = traits(GetParam().backend).mode, .thread_safety = GetParam().model};
  config.shared_send_buffers = {.use_shared_send_buffers = true, .buf_size = 0, .num_buf = 4};
  EXPECT_THROW((void)Netio3Backend::create(GetParam().backend, config, loop), InvalidConfiguration);
  NetworkConfig no_interrupted{.mode = config.mode, .thread_safety = config.thread_safety};
  no_interrupted.limits.max_interrupted_sessions = 0;
  EXPECT_THROW((void)Netio3Backend::create(GetParam().backend, no_interrupted, loop),
               InvalidConfiguration);
  EXPECT_THROW((void)Netio3Backend::create(GetParam().backend, {}, nullptr), std::invalid_argument);
  EXPECT_TRUE(Netio3Backend::is_available(GetParam().backend));
  for (const auto type : {BackendType::ASYNCMSG, BackendType::LIBFABRIC, BackendType::UCX}) {
    if (!Netio3Backend::is_available(type)) {
      EXPECT_THROW((void)Netio3Backend::create(type, {}, loop), InvalidConfiguration);
    }
  }
}

// Shared send buffers: every connection draws from one pool.
TEST_P(Api, SharedSendBuffersAreOnePoolForAllConnections) {
  auto server = make_node();
  auto node = make_node([](NetworkConfig& c) {
    c.shared_send_buffers = {.use_shared_send_buffers = true, .buf_size = 512, .num_buf = 3};
  });
  const auto a = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0},
                                                 receiver_params(BUF_SIZE));
  });
  const auto b = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0},
                                                 receiver_params(BUF_SIZE));
  });
  const ConnectionParameters params{.send_buffered_params = {.buf_size = 512, .num_buf = 1}};
  node->call([&] { node->backend->open_active_endpoint(a, params); });
  node->call([&] { node->backend->open_active_endpoint(b, params); });
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 2; }));
  auto* x = node->call([&] { return node->backend->get_buffer(a); });
  auto* y = node->call([&] { return node->backend->get_buffer(b); });
  auto* z = node->call([&] { return node->backend->get_buffer(a); });
  ASSERT_TRUE(x != nullptr && y != nullptr && z != nullptr);
  EXPECT_EQ(node->call([&] { return node->backend->get_buffer(b); }), nullptr)
      << "three shared buffers in total, whichever connection asks";
  for (auto* buf : {x, y, z}) buf->write(std::uint16_t{7});
  EXPECT_EQ(node->call([&] { return node->backend->send_buffer(a, x); }), NetioStatus::OK);
  EXPECT_EQ(node->call([&] { return node->backend->send_buffer(b, y); }), NetioStatus::OK);
  EXPECT_EQ(node->call([&] { return node->backend->send_buffer(b, z); }), NetioStatus::OK)
      << "a shared buffer may be sent on any connection";
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == 3; }));
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::COMPLETED) == 3; }));
  EXPECT_NE(node->call([&] { return node->backend->get_buffer(b); }), nullptr);
}

// The documentation's connection example: one backend listens and connects to itself.
TEST_P(Api, OneBackendCanConnectToItself) {
  auto node = make_node();
  const auto listen = node->call([&] {
    return node->backend->open_listen_endpoint({test::test_address(), 0},
                                               {.recv_params = {.buf_size = 4096, .num_buf = 16}});
  });
  node->call([&] {
    node->backend->open_active_endpoint(
        listen, {.send_buffered_params = {.buf_size = 4096, .num_buf = 16}});
  });
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 2; }));
  auto* buffer = node->call([&] { return node->backend->get_buffer(listen); });
  ASSERT_NE(buffer, nullptr);
  const auto message = test::pattern(3, 777);
  buffer->write(std::span<const std::uint8_t>{message});
  EXPECT_EQ(node->call([&] { return node->backend->send_buffer(listen, buffer); }),
            NetioStatus::OK);
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) {
    return r.count(Kind::DATA) == 1 && r.count(Kind::COMPLETED) == 1;
  }));
  EXPECT_EQ(node->rec.messages_snapshot().at(0), message);
  node->call([&] { node->backend->close_listen_endpoint(listen); });
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) == 2; }))
      << "the accepted side (closed with its listener) and the active side (closed by the peer)";
}

// Memory runs out while a connection is accepted: the listener asks for 4 TiB of send
// buffers per connection, which no allocator here can give (the sanitizer presets set
// allocator_may_return_null, so ASan and TSan fail the allocation as glibc does instead of
// aborting). The connection is dropped with the reason in the server's log and no callback
// on the server; the client is refused (asyncmsg: the server allocates once the client has
// greeted, and the greetings cross, so the client saw it established and then closed, with
// no key); the connection that was already open keeps working, and another listener of the
// same backend accepts a new connection afterwards.
TEST_P(Api, AConnectionWhoseBuffersCannotBeAllocatedIsDroppedAndNothingElseIsHurt) {
  test::LogCapture log{LogLevel::warn};
  auto server = make_node();
  auto client = make_node();
  const ConnectionParameters sender{.send_buffered_params = {.buf_size = 4096, .num_buf = 8}};
  const auto good = connect_to_new_listener(*server, *client, sender);
  ASSERT_TRUE(good.has_value());
  const ConnectionParameters unaffordable{
      .send_buffered_params = {.buf_size = std::size_t{1} << 40U, .num_buf = 4}};
  const auto greedy = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0}, unaffordable);
  });
  client->call([&] { client->backend->open_active_endpoint(greedy, sender); });
  if (GetParam().backend == BackendType::ASYNCMSG) {
    ASSERT_TRUE(client->rec.wait([&](const Recorder& r) {
      return r.count(Kind::ESTABLISHED, greedy) == 1 && r.count(Kind::CLOSED, greedy) == 1;
    })) << log.text();
    EXPECT_EQ(client->rec.count_now(Kind::REFUSED, greedy), 0U);
  } else {
    ASSERT_TRUE(client->rec.wait([&](const Recorder& r) {
      return r.count(Kind::REFUSED, greedy) == 1;
    })) << log.text();
    EXPECT_EQ(client->rec.count_now(Kind::ESTABLISHED, greedy), 0U);
  }
  EXPECT_TRUE(log.wait("bad_alloc", 1, LogLevel::warn)) << "no reason logged:\n" << log.text();
  // The server saw one connection (the good one) and nothing of the refused one.
  EXPECT_EQ(server->rec.count_now(Kind::ESTABLISHED), 1U);
  EXPECT_EQ(server->rec.count_now(Kind::CLOSED), 0U);
  // The open connection carries on.
  const auto message = test::pattern(11, 512);
  ASSERT_EQ(send_one(*client, *good, SendMode::BUFFERED, message, {}, 1), NetioStatus::OK);
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) == 1; }));
  EXPECT_EQ(server->rec.messages_snapshot().at(0), message);
  // And the backend accepts what it can afford.
  auto second = make_node();
  EXPECT_TRUE(connect_to_new_listener(*server, *second, sender).has_value());
  EXPECT_EQ(client->rec.count_now(Kind::CLOSED, *good), 0U);
}

// UNSAFE promises calls from the loop thread only; backends that honour it check it.
TEST_P(Api, UnsafeModelRejectsCallsFromForeignThreadsWhileTheLoopRuns) {
  if (GetParam().model == ThreadSafetyModel::SAFE) GTEST_SKIP() << "SAFE allows any thread";
  if (!traits(GetParam().backend).honours_unsafe) {
    GTEST_SKIP() << netio3::to_string(GetParam().backend) << " is always thread-safe (documented)";
  }
  auto node = make_node();
  EXPECT_THROW((void)node->backend->open_listen_endpoint({test::test_address(), 0}, {}),
               std::logic_error);
}

// The documented way to drive an UNSAFE backend: a signal fired from another thread runs
// the send on the loop thread.
TEST_P(Api, SendingThroughASignalFromAnotherThread) {
  auto server = make_node();
  auto node = make_node();
  const auto connected = connect_to_new_listener(
      *server, *node, {.send_buffered_params = {.buf_size = 64, .num_buf = 4}});
  ASSERT_TRUE(connected.has_value());
  const EndPointAddress listen = *connected;
  std::atomic<int> sent{0};
  auto signal = node->loop.loop()->create_signal(
      [&] {
        auto* buffer = node->backend->get_buffer(listen);
        if (buffer == nullptr) return;
        buffer->write(std::uint32_t{0xC0FFEE});
        if (node->backend->send_buffer(listen, buffer) == NetioStatus::OK) ++sent;
      },
      true);
  std::jthread firer{[&] {
    for (int i = 0; i < 3; ++i) signal.fire();
  }};
  firer.join();
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == 3; }));
  // The third message can arrive before its send_buffer call has returned: look at the
  // count from the loop thread, after the signal's callback.
  node->loop.loop()->run_sync([&] {
    EXPECT_EQ(sent.load(), 3);
    signal.close();
  });
}

// At debug level every connection event is logged, at trace level every send, receive and
// completion with endpoint, key and size.
TEST_P(Api, TraceLoggingNamesEndpointKeyAndSize) {
  std::mutex mutex;
  std::vector<std::string> lines;
  const LogLevel previous = log_level();
  set_log_sink([&](LogLevel, std::string_view message) {
    const std::lock_guard lock{mutex};
    lines.emplace_back(message);
  });
  set_log_level(LogLevel::trace);
  {
    auto server = make_node();
    auto node = make_node();
    const auto connected = connect_to_new_listener(
        *server, *node, {.send_buffered_params = {.buf_size = 1000, .num_buf = 2}});
    ASSERT_TRUE(connected.has_value());
    const EndPointAddress listen = *connected;
    auto* buffer = node->call([&] { return node->backend->get_buffer(listen); });
    ASSERT_NE(buffer, nullptr);
    buffer->write(std::vector<std::uint8_t>(321, 1));
    const auto key = buffer->id();
    ASSERT_EQ(node->call([&] { return node->backend->send_buffer(listen, buffer); }),
              NetioStatus::OK);
    ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) == 1; }));
    ASSERT_TRUE(node->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) == 1; }));
    node->call([&] { node->backend->close_active_endpoint(listen); });
    ASSERT_TRUE(node->rec.wait([](const Recorder& r) { return r.count(Kind::CLOSED) == 1; }));
    set_log_level(previous);
    set_log_sink({});
    const auto endpoint = to_string(listen);
    const auto key_text = fmt::format("key={}", key);
    const auto logged = [&](std::initializer_list<std::string_view> words) {
      const std::lock_guard lock{mutex};
      return std::any_of(lines.begin(), lines.end(), [&](const std::string& line) {
        return std::all_of(words.begin(), words.end(),
                           [&](std::string_view w) { return line.find(w) != std::string::npos; });
      });
    };
    EXPECT_TRUE(logged({"send", endpoint, key_text, "size=321"})) << "trace: the send";
    EXPECT_TRUE(logged({"recv", "size=321"})) << "trace: the receive";
    EXPECT_TRUE(logged({"completed", endpoint, key_text})) << "trace: the completion";
    EXPECT_TRUE(logged({"established", endpoint})) << "debug: the connection";
    EXPECT_TRUE(logged({"closed", endpoint})) << "debug: the close";
  }
  set_log_level(previous);
  set_log_sink({});
}

TEST_P(Api, UnsupportedSendModesSayNotSupported) {
  const auto& t = traits(GetParam().backend);
  if (t.copy_supported)
    GTEST_SKIP() << netio3::to_string(GetParam().backend) << " supports send_data_copy";
  auto server = make_node();
  auto node = make_node();
  const auto connected = connect_to_new_listener(
      *server, *node, {.send_buffered_params = {.buf_size = 64, .num_buf = 2}});
  ASSERT_TRUE(connected.has_value());
  const std::vector<std::uint8_t> data(8);
  EXPECT_THROW(node->call([&] { return node->backend->send_data_copy(*connected, data, {}, 1); }),
               NotSupported);
  for (const auto& e : node->rec.snapshot()) {
    if (e.kind == Kind::ESTABLISHED) {
      EXPECT_FALSE(e.caps.send_copy);
    }
  }
  // Zero-copy was not requested (no region): sending zero-copy is not possible either.
  if (t.zero_copy_needs_region) {
    std::vector<std::uint8_t> payload(8);
    EXPECT_THROW(node->call([&] { return node->backend->send_data(*connected, payload, {}, 2); }),
                 NotSupported);
  }
}

// Every backend, also one that could send from anywhere (asyncmsg): code tested on one
// behaves the same on the others.
TEST_P(Api, ZeroCopyFromOutsideTheConfiguredRegionFails) {
  auto server = make_node();
  auto node = make_node();
  std::vector<std::uint8_t> region(1024);
  std::vector<std::uint8_t> elsewhere(16);
  const auto connected = connect_to_new_listener(
      *server, *node,
      {.send_zero_copy_params = {.buf_size = region.size(), .mr_start = region.data()}});
  ASSERT_TRUE(connected.has_value());
  const auto to = *connected;
  EXPECT_EQ(node->call([&] { return node->backend->send_data(to, elsewhere, {}, 1); }),
            NetioStatus::FAILED);
  // Straddling the end of the region (an iovec: a span cannot reach past the vector).
  const iovec straddling{region.data() + 1000, 30};
  EXPECT_EQ(node->call([&] {
    return node->backend->send_data(to, std::span<const iovec>{&straddling, 1}, {}, 2);
  }),
            NetioStatus::FAILED);
  // Inside it, with a header from anywhere (headers are copied).
  const std::vector<std::uint8_t> header{9, 8, 7};
  std::fill(region.begin() + 100, region.begin() + 110, std::uint8_t{5});
  EXPECT_EQ(node->call([&] {
    return node->backend->send_data(to, std::span{region}.subspan(100, 10), header, 3);
  }),
            NetioStatus::OK);
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) == 1; }));
  const auto message = server->rec.messages_snapshot().at(0);
  ASSERT_EQ(message.size(), 13U);
  EXPECT_EQ(message[0], 9);
  EXPECT_EQ(message[3], 5);
  ASSERT_TRUE(node->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) == 1; }));
  EXPECT_EQ(node->rec.snapshot().back().key, 3U) << "refused sends leave no key behind";
  EXPECT_EQ(server->rec.count_now(Kind::DATA), 1U) << "nothing of the refused sends arrived";
}

// Without a configured region a backend that does not register memory (asyncmsg) sends
// zero-copy from anywhere; the others say NotSupported (UnsupportedSendModesSayNotSupported).
TEST_P(Api, ZeroCopyWithoutARegionSendsFromAnywhereWhereNoneIsNeeded) {
  if (traits(GetParam().backend).zero_copy_needs_region) {
    GTEST_SKIP() << netio3::to_string(GetParam().backend) << " needs a registered region";
  }
  auto server = make_node();
  auto node = make_node();
  const auto connected = connect_to_new_listener(*server, *node, {});
  ASSERT_TRUE(connected.has_value());
  std::vector<std::uint8_t> anywhere(16, 3);
  EXPECT_EQ(node->call([&] { return node->backend->send_data(*connected, anywhere, {}, 1); }),
            NetioStatus::OK);
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) == 1; }));
  // The payload stays untouched until its key is reported (the data may arrive first).
  ASSERT_TRUE(node->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) == 1; }));
}

TEST_P(Api, BufferedAndZeroCopyOnOneEndpointAreRejectedWhereExclusive) {
  if (!traits(GetParam().backend).buffered_zero_copy_exclusive) {
    GTEST_SKIP() << netio3::to_string(GetParam().backend) << " can do both on one endpoint";
  }
  auto node = make_node();
  std::vector<std::uint8_t> region(64);
  EXPECT_THROW(node->call([&] {
    node->backend->open_active_endpoint(
        {test::test_address(), test::unused_port()},
        {.send_buffered_params = {.buf_size = 64, .num_buf = 2},
         .send_zero_copy_params = {.buf_size = region.size(), .mr_start = region.data()}});
  }),
               InvalidConnectionParameters);
}

// The receiver's limit (max_message_size, and its receive buffers where the transport needs
// them) is known to the sender: one byte more is FAILED there, and nothing breaks.
TEST_P(Api, MessagesLargerThanThePeerAcceptsFailAtTheSender) {
  constexpr std::size_t LIMIT = 4096;
  auto server = make_node([](NetworkConfig& c) { c.limits.max_message_size = LIMIT; });
  auto node = make_node();
  const auto listen = server->call([&] {
    return server->backend->open_listen_endpoint(
        {test::test_address(), 0}, {.recv_params = {.buf_size = LIMIT, .num_buf = 8}});
  });
  node->call([&] {
    node->backend->open_active_endpoint(
        listen, {.send_buffered_params = {.buf_size = 2 * LIMIT, .num_buf = 4}});
  });
  ASSERT_TRUE(node->rec.wait([](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
  for (const std::size_t size : {LIMIT + 1, LIMIT}) {
    auto* buffer = node->call([&] { return node->backend->get_buffer(listen); });
    ASSERT_NE(buffer, nullptr);
    buffer->write(test::pattern(size, size));
    // The reason is the calling thread's: read it in the same call.
    SendFailure failure;
    const auto status = node->call([&] {
      const auto s = node->backend->send_buffer(listen, buffer);
      failure = last_send_failure();
      return s;
    });
    if (size > LIMIT) {
      EXPECT_EQ(status, NetioStatus::FAILED) << size << " bytes";
      EXPECT_EQ(failure.cause, SendFailureCause::TOO_LARGE) << failure.message;
      EXPECT_THAT(failure.message, testing::HasSubstr(fmt::format("{} bytes", LIMIT + 1)));
      buffer->clear();  // still ours: reuse it
      buffer->write(test::pattern(size, LIMIT));
      EXPECT_EQ(node->call([&] { return node->backend->send_buffer(listen, buffer); }),
                NetioStatus::OK);
    } else {
      EXPECT_EQ(status, NetioStatus::OK);
    }
  }
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::DATA) == 2; }));
  for (const auto& m : server->rec.messages_snapshot()) EXPECT_EQ(m.size(), LIMIT);
  EXPECT_EQ(node->rec.count_now(Kind::CLOSED), 0U);
  EXPECT_EQ(server->rec.count_now(Kind::CLOSED), 0U);
}

// Receive buffers shared by all connections (NetworkConfig) or by those of one listener
// (recv_params.use_shared_receive_buffers): several connections stream at once, each in order.
TEST_P(Api, SharedReceiveBuffersServeSeveralConnections) {
  for (const bool per_listener : {false, true}) {
    SCOPED_TRACE(per_listener ? "per listener" : "backend-wide");
    auto server = make_node([&](NetworkConfig& c) {
      if (!per_listener)
        c.shared_receive_buffers = {
            .use_shared_receive_buffers = true, .buf_size = 1024, .num_buf = 32};
    });
    const ConnectionParameters listen_params =
        per_listener ? ConnectionParameters{.recv_params = {.buf_size = 1024,
                                                            .num_buf = 32,
                                                            .use_shared_receive_buffers = true}}
                     : ConnectionParameters{};
    const auto listen = server->call([&] {
      return server->backend->open_listen_endpoint({test::test_address(), 0}, listen_params);
    });
    constexpr int CLIENTS = 3;
    constexpr std::uint64_t MESSAGES = 100;
    std::vector<std::unique_ptr<Node>> clients;
    for (int c = 0; c < CLIENTS; ++c) {
      clients.push_back(make_node());
      clients.back()->call([&] {
        clients.back()->backend->open_active_endpoint(
            listen, {.send_buffered_params = {.buf_size = 1024, .num_buf = 8}});
      });
    }
    for (auto& c : clients) {
      ASSERT_TRUE(c->rec.wait([](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
    }
    for (std::uint64_t i = 0; i < MESSAGES; ++i) {
      for (int c = 0; c < CLIENTS; ++c) {
        // Message: client number, then a pattern of the per-client sequence number.
        auto message = test::pattern(i * CLIENTS + static_cast<std::uint64_t>(c), 200);
        message[0] = static_cast<std::uint8_t>(c);
        ASSERT_EQ(send_one(*clients[static_cast<std::size_t>(c)], listen, SendMode::BUFFERED,
                           message, {}, i),
                  NetioStatus::OK);
      }
    }
    ASSERT_TRUE(server->rec.wait(
        [&](const Recorder& r) { return r.count(Kind::DATA) == CLIENTS * MESSAGES; }));
    std::array<std::uint64_t, CLIENTS> next{};
    for (const auto& m : server->rec.messages_snapshot()) {
      ASSERT_EQ(m.size(), 200U);
      const auto c = static_cast<std::size_t>(m[0]);
      ASSERT_LT(c, static_cast<std::size_t>(CLIENTS));
      auto expected = test::pattern(next[c] * CLIENTS + c, 200);
      expected[0] = static_cast<std::uint8_t>(c);
      ASSERT_EQ(m, expected) << "client " << c << " message " << next[c];
      ++next[c];
    }
  }
}

// Large and small messages back to back: a small one must not overtake a large one sent
// before it (with UCX, messages above ~8 KiB go rendezvous and complete after later eager
// ones unless the receiver restores the order).
TEST_P(Api, SmallMessagesDoNotOvertakeLargerOnesSentBefore) {
  constexpr std::size_t BIG = std::size_t{64} << 10U;
  auto server = make_node();
  auto node = make_node();
  const auto listen = server->call([&] {
    return server->backend->open_listen_endpoint({test::test_address(), 0}, receiver_params(BIG));
  });
  node->call([&] {
    node->backend->open_active_endpoint(
        listen, {.send_buffered_params = {.buf_size = BIG, .num_buf = NUM_BUF}});
  });
  ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
  constexpr std::array<std::size_t, 6> SIZES{BIG, 16, 20000, 1, 9000, 0};
  constexpr std::uint64_t MESSAGES = 240;
  for (std::uint64_t i = 0; i < MESSAGES; ++i) {
    ASSERT_EQ(send_one(*node, listen, SendMode::BUFFERED, test::pattern(i, SIZES[i % SIZES.size()]),
                       {}, i),
              NetioStatus::OK)
        << "message " << i;
  }
  ASSERT_TRUE(server->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == MESSAGES; }));
  const auto messages = server->rec.messages_snapshot();
  for (std::uint64_t i = 0; i < MESSAGES; ++i) {
    ASSERT_EQ(messages.at(i), test::pattern(i, SIZES[i % SIZES.size()])) << "message " << i;
  }
}

// Event-driven, not polling: a ping-pong wakes each loop about once per message.
TEST_P(Api, PingPongWakesEachLoopAboutOncePerMessage) {
  auto server = make_node();
  auto node = make_node();
  const auto connected =
      connect_to_new_listener(*server, *node,
                              {.recv_params = {.buf_size = 256, .num_buf = 8},
                               .send_buffered_params = {.buf_size = 256, .num_buf = 8}});
  ASSERT_TRUE(connected.has_value());
  const EndPointAddress listen = *connected;
  ASSERT_TRUE(server->rec.wait([](const Recorder& r) { return r.count(Kind::ESTABLISHED) == 1; }));
  EndPointAddress back;
  for (const auto& e : server->rec.snapshot()) {
    if (e.kind == Kind::ESTABLISHED) back = e.remote;
  }
  server->rec.keep_data(false);
  node->rec.keep_data(false);
  server->rec.set_hook([&](const Recorder::Event& e, std::span<const std::uint8_t> bytes) {
    if (e.kind != Kind::DATA) return;
    auto* buffer = server->backend->get_buffer(back);
    ASSERT_NE(buffer, nullptr);
    buffer->write(bytes);
    ASSERT_EQ(server->backend->send_buffer(back, buffer), NetioStatus::OK);
  });
  constexpr std::size_t ROUNDS = 200;
  const auto client_before = node->loop.loop()->wakeups();
  const auto server_before = server->loop.loop()->wakeups();
  for (std::size_t i = 0; i < ROUNDS; ++i) {
    ASSERT_EQ(node->call([&] {
      auto* buffer = node->backend->get_buffer(listen);
      if (buffer == nullptr) return NetioStatus::NO_RESOURCES;
      buffer->write(std::uint64_t{i});
      return node->backend->send_buffer(listen, buffer);
    }),
              NetioStatus::OK);
    ASSERT_TRUE(node->rec.wait([&](const Recorder& r) { return r.count(Kind::DATA) == i + 1; }));
  }
  const double client = static_cast<double>(node->loop.loop()->wakeups() - client_before) / ROUNDS;
  const double server_rate =
      static_cast<double>(server->loop.loop()->wakeups() - server_before) / ROUNDS;
  RecordProperty("client_wakeups_per_round_trip", std::to_string(client));
  RecordProperty("server_wakeups_per_round_trip", std::to_string(server_rate));
  std::cout << fmt::format("[ wakeups  ] per round trip: client {:.2f}, server {:.2f}\n", client,
                           server_rate);
  // A loop wakes once per batch of completions (a message arriving while a batch is read
  // is handled in the same batch, so fewer than one per message is possible); a busy loop
  // would show thousands. The client's UNSAFE calls go through run_sync, which wakes its
  // loop once more.
  const double client_bound = GetParam().model == ThreadSafetyModel::UNSAFE ? 4.0 : 3.0;
  EXPECT_GT(server_rate, 0.0);
  EXPECT_LE(server_rate, 3.0);
  EXPECT_GT(client, 0.0);
  EXPECT_LE(client, client_bound);

  // Connected but quiet: once every send has completed on both sides, neither loop wakes
  // while 200 ms pass (timed by a one-shot timer on the client's loop, waited for with a
  // deadline).
  ASSERT_TRUE(node->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) == ROUNDS; }));
  ASSERT_TRUE(
      server->rec.wait([](const Recorder& r) { return r.count(Kind::COMPLETED) == ROUNDS; }));
  std::mutex mutex;
  std::condition_variable cv;
  bool fired = false;
  const auto idle_client = node->loop.loop()->wakeups();
  const auto idle_server = server->loop.loop()->wakeups();
  auto timer = node->loop.loop()->create_timer([&] {
    const std::lock_guard lock{mutex};
    fired = true;
    cv.notify_all();
  });
  timer.start_once(std::chrono::milliseconds{200});
  {
    std::unique_lock lock{mutex};
    ASSERT_TRUE(cv.wait_for(lock, test::DEFAULT_TIMEOUT, [&] { return fired; }));
  }
  // The timer wakes the client's loop once; a wake-up may be followed by a re-poll or two
  // (fi_trywait can ask for one more look right after an event). A busy loop would show
  // thousands in 200 ms.
  EXPECT_LE(node->loop.loop()->wakeups() - idle_client, 4U);
  EXPECT_LE(server->loop.loop()->wakeups() - idle_server, 4U);
  node->loop.loop()->run_sync([&] { timer.close(); });
}

INSTANTIATE_TEST_SUITE_P(Conformance, Api, testing::ValuesIn(all_params()), param_name);

}  // namespace
}  // namespace netio3::conformance
