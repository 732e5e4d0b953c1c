// Several readouts into one event builder, each in its own process (examples/readout.cpp,
// examples/event_builder.cpp): every readout closes right after its last send completed, and
// the builder must have received every fragment of every readout, whole and in order. On
// libfabric a close used to drop what the builder's provider had received but the builder
// had not read yet (2-424 fragments of a stream with four readouts at once).

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "test_support.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Child = netio3::test::ChildProcess;

constexpr int READOUTS = 4;
// Twenty rounds as the users ran them; three under a sanitizer (5-15 times slower).
constexpr int ROUNDS = netio3::test::SANITIZED ? 3 : 20;

struct FanInCase {
  std::string backend;
  std::size_t size;
  std::uint64_t fragments;       // per readout: far more than the builder's buffers hold
  bool acknowledged{false};      // the readouts' sends are acknowledged (DeliveryParameters)
  bool close_after_send{false};  // a readout closes right after its last send (drains)
  bool session{false};           // and its connection has a session (asyncmsg)
};

void PrintTo(const FanInCase& c, std::ostream* os) {
  *os << fmt::format("{} x {} fragments of {} bytes{}{}", c.backend, c.fragments, c.size,
                     c.session        ? ", with sessions"
                     : c.acknowledged ? ", acknowledged"
                                      : "",
                     c.close_after_send ? ", closed after the last send" : "");
}

std::string name_of(const ::testing::TestParamInfo<FanInCase>& info) {
  return fmt::format("{}_{}{}{}", info.param.backend,
                     info.param.size >= 1024 * 1024 ? "1MiB" : fmt::format("{}B", info.param.size),
                     info.param.session        ? "_session"
                     : info.param.acknowledged ? "_acknowledged"
                                               : "",
                     info.param.close_after_send ? "_closed_after_send" : "");
}

std::vector<FanInCase> cases() {
  std::vector<FanInCase> all;
  for (const auto type : netio3::Netio3Backend::available()) {
    const std::string name{netio3::to_string(type)};
    all.push_back({name, 4096, 4000});
    all.push_back({name, 1024 * 1024, 64});
    all.push_back({name, 4096, 4000, true});
    all.push_back({name, 1024 * 1024, 64, true});
    all.push_back({name, 4096, 4000, true, true});
    all.push_back({name, 1024 * 1024, 64, true, true});
    if (type == netio3::BackendType::ASYNCMSG) {
      all.push_back({name, 4096, 4000, true, true, true});
      all.push_back({name, 1024 * 1024, 64, true, true, true});
    }
  }
  return all;
}

// The port from the builder's "listening on 127.0.0.1:PORT" line.
std::optional<std::string> listening_port(Child& builder) {
  constexpr std::string_view PREFIX = "listening on 127.0.0.1:";
  std::optional<std::string> port;
  builder.read_until(
      [&](const std::string& out) {
        const auto at = out.find(PREFIX);
        if (at == std::string::npos) return false;
        const auto end = out.find('\n', at);
        if (end == std::string::npos) return false;
        port = out.substr(at + PREFIX.size(), end - at - PREFIX.size());
        return true;
      },
      Clock::now() + 60s);
  return port;
}

class FanIn : public ::testing::TestWithParam<FanInCase> {
 protected:
  void SetUp() override {
    if (GetParam().backend == "libfabric") ::setenv("FI_PROVIDER", "tcp", 1);
  }
  void TearDown() override { ::unsetenv("FI_PROVIDER"); }
};

TEST_P(FanIn, ReadoutsThatCloseAfterTheirLastCompletionLoseNothing) {
  const auto& c = GetParam();
  const std::string fragments = std::to_string(c.fragments);
  const std::string size = std::to_string(c.size);
  // Acknowledged: fewer rounds (what they add is the acknowledgements between processes).
  const int rounds = c.acknowledged ? std::max(ROUNDS / 4, 2) : ROUNDS;
  for (int round = 0; round < rounds; ++round) {
    SCOPED_TRACE(fmt::format("round {} of {}", round + 1, rounds));
    Child builder{{EXAMPLE_EVENT_BUILDER, "--backend", c.backend, "--readouts",
                   std::to_string(READOUTS), "--size", size, "--expect", fragments}};
    const auto port = listening_port(builder);
    ASSERT_TRUE(port.has_value()) << builder.describe();
    std::vector<std::unique_ptr<Child>> readouts;
    for (int i = 0; i < READOUTS; ++i) {
      readouts.push_back(std::make_unique<Child>(std::vector<std::string>{
          EXAMPLE_READOUT, "--backend", c.backend, "--port", *port, "--size", size, "--fragments",
          fragments, "--acknowledged", c.acknowledged ? "1" : "0", "--close-after-send",
          c.close_after_send ? "1" : "0", "--session", c.session ? "1" : "0"}));
    }
    const auto deadline = Clock::now() + 120s;
    for (auto& r : readouts) {
      // Every send completed and none was cancelled: the readout saw a clean stream.
      ASSERT_EQ(r->wait(deadline), 0) << r->describe();
      EXPECT_NE(r->out().find(fmt::format("sent {0}, completed {0}, cancelled 0", c.fragments)),
                std::string::npos)
          << r->describe();
    }
    // ... and the builder got all of it.
    ASSERT_EQ(builder.wait(deadline), 0) << builder.describe();
    EXPECT_NE(builder.out().find(fmt::format("received {} fragments", READOUTS * c.fragments)),
              std::string::npos)
        << builder.describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Examples, FanIn, ::testing::ValuesIn(cases()), name_of);

}  // namespace
