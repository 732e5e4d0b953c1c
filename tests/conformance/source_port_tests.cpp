// Many connections from one client to one server (issue 22): every connection a netio3 client
// opens has a source port of its own, so that a server, which knows a connection by its
// remote address, never sees two of them from one address and never refuses one for it.
//
// Linux picks an unbound socket's source port per destination: two sockets of one process
// that connect to two ports of one server may get the same one (a birthday problem over the
// ephemeral range; for 64 connections about 7% per round before the fix).

#include <string>
#include <vector>

#include "conformance.hpp"

namespace netio3::conformance {
namespace {

class SourcePorts : public testing::TestWithParam<BackendType> {};

TEST_P(SourcePorts, SixtyFourConnectionsToSixtyFourListenersAreNeverRefused) {
  constexpr std::size_t LISTENERS = 64;
  constexpr int ROUNDS = 50;
  Node server{GetParam(), ThreadSafetyModel::SAFE};
  Node client{GetParam(), ThreadSafetyModel::SAFE};
  std::vector<EndPointAddress> listens;
  for (std::size_t i = 0; i < LISTENERS; ++i) {
    listens.push_back(server.backend->open_listen_endpoint({test::test_address(), 0},
                                                           receiver_params(BUF_SIZE)));
  }
  std::vector<std::uint8_t> region;
  for (int round = 1; round <= ROUNDS; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    for (const auto& to : listens) {
      client.backend->open_active_endpoint(
          to, sender_params(client.traits, SendMode::BUFFERED, region));
    }
    const auto up = static_cast<std::size_t>(round) * LISTENERS;
    ASSERT_TRUE(client.rec.wait([&](const Recorder& r) {
      return r.count(Kind::ESTABLISHED) + r.count(Kind::REFUSED) >= up;
    })) << "connections did not finish setting up";
    ASSERT_TRUE(server.rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED) >= up; }))
        << "the server established " << server.rec.count_now(Kind::ESTABLISHED) << " of " << up;
    ASSERT_EQ(client.rec.count_now(Kind::REFUSED), 0U);
    ASSERT_EQ(client.rec.count_now(Kind::ESTABLISHED), up);
    for (const auto& to : listens) client.backend->close_active_endpoint(to);
    ASSERT_TRUE(client.rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) >= up; }));
    ASSERT_TRUE(server.rec.wait([&](const Recorder& r) { return r.count(Kind::CLOSED) >= up; }));
  }
}

std::vector<BackendType> fixed_backends() {
  std::vector<BackendType> out;
  for (const auto type : backends()) {
    out.push_back(type);
  }
  return out;
}

std::string backend_name(const testing::TestParamInfo<BackendType>& param_info) {
  return std::string{netio3::to_string(param_info.param)};
}

INSTANTIATE_TEST_SUITE_P(Conformance, SourcePorts, testing::ValuesIn(fixed_backends()),
                         backend_name);

}  // namespace
}  // namespace netio3::conformance
