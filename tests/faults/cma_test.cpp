// UCX in RDMA mode between two processes of one host: large messages go by CMA (the
// receiving process reads the sender's memory with process_vm_readv), which netio3 turns on
// under peer error handling (docs/ucx.md). The kernel lets a process read another only with
// ptrace access: a peer that made itself non-dumpable (PR_SET_DUMPABLE 0) cannot be read,
// and UCX would fail the connection at the first large message. netio3 then makes the
// endpoints without CMA (the large messages go over tcp), on both sides.
//
// The kernel's rule (ptrace access): the same user and group ids and a dumpable target, or
// CAP_SYS_PTRACE in the reader. Both sides must agree (an endpoint with CMA on one side
// only fails at its set-up): each asks the kernel whether it may read the peer and works
// out the other direction by the rule.
//
// What must hold, with the peer sending and with it receiving 1 MiB zero-copy messages:
// every message arrives intact and in order, every send completes once; and the lanes are
// the expected ones: CMA between processes that may read each other, none otherwise (the
// peer's UCX prints its endpoint configurations at UCX_LOG_LEVEL=info, and its netio3 log
// says why CMA is not used). Peers: this process's user; the same but non-dumpable (CMA
// still, where this process has CAP_SYS_PTRACE, as root has); another user (nobody).

#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "fault_fixture.hpp"

namespace netio3::faults {
namespace {

constexpr std::size_t SIZE = std::size_t{1} << 20U;
constexpr std::uint64_t COUNT = 200;  // 200 MiB each way

enum class Peer {
  SAME_USER,   // this process's user, dumpable
  UNDUMPABLE,  // this process's user, PR_SET_DUMPABLE 0 before its backend exists
  OTHER_USER,  // nobody (setpriv; needs root): neither may read the other
};

struct CmaCase {
  const char* name;
  Peer peer;
  bool peer_sends;
};

constexpr std::array CMA_CASES{
    CmaCase{"SameUserPeerSends", Peer::SAME_USER, true},
    CmaCase{"SameUserPeerReceives", Peer::SAME_USER, false},
    CmaCase{"UndumpablePeerSends", Peer::UNDUMPABLE, true},
    CmaCase{"UndumpablePeerReceives", Peer::UNDUMPABLE, false},
    CmaCase{"OtherUserPeerSends", Peer::OTHER_USER, true},
    CmaCase{"OtherUserPeerReceives", Peer::OTHER_USER, false},
};

// Whether this process has CAP_SYS_PTRACE (root has): it may read any process, and its
// children, which inherit it, may read it.
bool can_trace_anyone() {
  std::ifstream status{"/proc/self/status"};
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("CapEff:")) {
      return ((std::stoull(line.substr(7), nullptr, 16) >> 19U) & 1U) != 0;  // CAP_SYS_PTRACE
    }
  }
  return false;
}

// UCX leaves CMA out itself where Yama allows no ptrace between processes of one user.
std::string why_no_cma_here() {
  std::ifstream scope{"/proc/sys/kernel/yama/ptrace_scope"};
  int value = 0;
  if (scope >> value && value >= 2) {
    return fmt::format("Yama ptrace_scope is {}: UCX does not offer CMA", value);
  }
  return {};
}

// The endpoint configurations UCX printed (UCX_LOG_LEVEL=info): "ep_cfg[N]: ..." lines.
std::vector<std::string> endpoint_configurations(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in{output};
  for (std::string line; std::getline(in, line);) {
    if (line.find("ep_cfg[") != std::string::npos) lines.push_back(line);
  }
  return lines;
}

class SameHostCma : public ::testing::TestWithParam<CmaCase> {
 protected:
  [[nodiscard]] const CmaCase& kase() const { return GetParam(); }
};

TEST_P(SameHostCma, LargeMessagesArriveIntactByTheLaneThePeersAllow) {
  if (!Netio3Backend::is_available(BackendType::UCX))
    GTEST_SKIP() << "the UCX backend is not built";
  if (const auto why = why_no_cma_here(); !why.empty()) GTEST_SKIP() << why;
  const std::vector<std::string> as_nobody{"setpriv", "--reuid=65534", "--regid=65534",
                                           "--clear-groups", "--"};
  if (kase().peer == Peer::OTHER_USER) {
    if (::geteuid() != 0) GTEST_SKIP() << "running the peer as another user needs root";
    // The build tree may lie under a folder only root may enter.
    std::vector<std::string> probe = as_nobody;
    probe.insert(probe.end(), {"test", "-x", NETIO3_FAULT_PEER});
    ChildProcess check{probe};
    if (check.wait(Clock::now() + WAIT) != 0) {
      GTEST_SKIP() << "user nobody cannot run " << NETIO3_FAULT_PEER << "\n" << check.describe();
    }
  }
  // CMA both ways, or not at all: a process with CAP_SYS_PTRACE (and its children) may read
  // a non-dumpable one.
  const bool expect_cma =
      kase().peer == Peer::SAME_USER || (kase().peer == Peer::UNDUMPABLE && can_trace_anyone());
  std::vector<std::uint8_t> region(64 * SIZE);
  const auto params =
      connection_params(kase().peer_sends ? SendMode::COPY : SendMode::ZERO_COPY, SIZE, region);
  Side side{BackendType::UCX, SIZE, {}, NetworkMode::RDMA};
  PeerOptions options;
  options.backend = BackendType::UCX;
  options.network = NetworkMode::RDMA;
  options.listen = test::test_address();
  options.send = kase().peer_sends;
  options.messages = COUNT;
  options.size = SIZE;
  options.mode = SendMode::ZERO_COPY;
  options.undumpable = kase().peer == Peer::UNDUMPABLE;
  if (kase().peer == Peer::OTHER_USER) {
    options.prefix = as_nobody;
  }
  options.environment = {"UCX_LOG_LEVEL=info", "NETIO3_LOG_LEVEL=info"};
  std::unique_ptr<ChildProcess> peer;
  const auto remote = connect_peer(side, peer, options, params, std::nullopt);
  ASSERT_TRUE(remote.has_value());
  if (kase().peer_sends) {
    // The peer sends COUNT messages and closes once they completed.
    ASSERT_TRUE(side.wait_closed(*remote, Clock::now() + 2 * WAIT).has_value()) << peer->describe();
    const auto stream = side.observer.stream_copy(1);
    EXPECT_EQ(stream.received, COUNT) << peer->describe();
    EXPECT_EQ(stream.bad, 0U) << stream.first_error;
  } else {
    StreamSender sender{*side.backend, side.observer,
                        StreamPlan{.to = *remote,
                                   .mode = SendMode::ZERO_COPY,
                                   .message_size = SIZE,
                                   .stream = 1,
                                   .count = COUNT},
                        region};
    ASSERT_EQ(sender.run({}, Clock::now() + 2 * WAIT), StreamEnd::COUNT_REACHED) << sender.error();
    ASSERT_TRUE(side.observer.wait(
        [&](const Observer& o) { return o.connection(*remote)->ledger.completed == COUNT; },
        Clock::now() + WAIT))
        << side.observer.connection_copy(*remote)->ledger.summary() << "\n"
        << peer->describe();
    side.backend->close_active_endpoint(*remote);
    ASSERT_TRUE(side.wait_closed(*remote, Clock::now() + WAIT).has_value());
    const auto conn = side.observer.connection_copy(*remote);
    EXPECT_TRUE(conn->ledger.violations.empty()) << conn->ledger.summary();
    EXPECT_EQ(conn->ledger.cancelled, 0U) << conn->ledger.summary();
  }
  EXPECT_EQ(peer->wait(), 0) << peer->describe();
  EXPECT_NE(line_starting(peer->out(), kase().peer_sends ? "DONE sent=" : "DONE received="),
            std::nullopt)
      << peer->describe();
  EXPECT_TRUE(side.observer.violations_copy().empty());

  // The lanes the peer's endpoint got.
  const auto configurations = endpoint_configurations(peer->out());
  ASSERT_FALSE(configurations.empty()) << "UCX printed no endpoint configuration\n"
                                       << peer->describe();
  const bool cma = std::any_of(configurations.begin(), configurations.end(), [](const auto& line) {
    return line.find("cma/") != std::string::npos;
  });
  const bool refused = peer->err().find("not CMA") != std::string::npos;
  if (expect_cma) {
    EXPECT_TRUE(cma) << "no CMA lane between processes that may read each other\n"
                     << peer->describe();
    EXPECT_FALSE(refused) << peer->describe();
  } else {
    EXPECT_FALSE(cma) << "a CMA lane between processes that may not read each other\n"
                      << peer->describe();
    EXPECT_TRUE(refused) << "the peer did not log why CMA is not used\n" << peer->describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Faults, SameHostCma, ::testing::ValuesIn(CMA_CASES),
                         [](const auto& param_info) { return std::string{param_info.param.name}; });

}  // namespace
}  // namespace netio3::faults
