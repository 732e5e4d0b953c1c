// Every listening socket of a server process, as an operator would find them with
// `ss -ltnp`: netio3's own port and those the transports open themselves (UCX's tcp
// transport listens on each device it uses; libfabric's tcp provider on its listener). The
// server is netio3-perf --server in a child process, bound to 127.0.0.1.
//
//  - No socket of the process listens on another address than the one asked for.
//  - On each port in turn: hostile bytes (garbage, a crafted length header, HTTP, half a
//    greeting, a reset), then 1100 connections held for 3 s and closed, with the soft
//    descriptor limit at the usual 1024. The process lives, and a netio3-perf client then
//    moves data intact.
//  - With `ulimit -n 80` (soft and hard) and 300 connections held against netio3's port: the
//    server uses under 10% of a core, logs the reason once, and serves a client afterwards.

#include <arpa/inet.h>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <dirent.h>
#include <fstream>
#include <netinet/in.h>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <sys/resource.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "proc_sockets.hpp"
#include "test_support.hpp"

namespace netio3::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Target {
  BackendType type;
  NetworkMode mode;
  // The server's environment (a VAR=value word for sh) and what the name says of it.
  std::string_view environment{};
  std::string_view suffix{};
  // Admission (docs/admission.md): server and clients run with --partition-key.
  std::string_view partition_key{};
};

std::string target_name(const ::testing::TestParamInfo<Target>& info) {
  return fmt::format("{}_{}{}", to_string(info.param.type), to_string(info.param.mode),
                     info.param.suffix);
}

// The TCP sockets process `pid` listens on.
std::vector<EndPointAddress> listening_sockets(pid_t pid) {
  std::vector<EndPointAddress> out;
  for (const auto& s : test::listening_sockets(std::to_string(pid))) out.push_back({s.ip, s.port});
  return out;
}

// The number of descriptors process `pid` has open (-1 if it cannot be read).
long open_descriptors(pid_t pid) {
  const std::string fd_dir = fmt::format("/proc/{}/fd", pid);
  DIR* dir = ::opendir(fd_dir.c_str());
  if (dir == nullptr) return -1;
  long n = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n;
}

bool alive(pid_t pid) {
  std::ifstream stat{fmt::format("/proc/{}/stat", pid)};
  std::string pid_text, name, state;
  stat >> pid_text >> name >> state;
  return stat && state != "Z" && state != "X";
}

// CPU time of process `pid`, all threads (utime + stime).
std::chrono::milliseconds cpu_time(pid_t pid) {
  std::ifstream stat{fmt::format("/proc/{}/stat", pid)};
  std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  std::istringstream rest{all.substr(all.rfind(')') + 2)};
  std::vector<std::string> fields{std::istream_iterator<std::string>(rest), {}};
  const long ticks = ::sysconf(_SC_CLK_TCK);
  const auto utime = std::stoull(fields.at(11));
  const auto stime = std::stoull(fields.at(12));
  return std::chrono::milliseconds{(utime + stime) * 1000 / static_cast<unsigned long long>(ticks)};
}

// A client socket to `to`; -1 if it could not even be started.
int start_connect(const EndPointAddress& to) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(to.port);
  ::inet_pton(AF_INET, to.address.c_str(), &sa.sin_addr);
  (void)::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));  // NOLINT
  return fd;
}

void send_and_close(const EndPointAddress& to, const std::string& bytes, bool reset) {
  const int fd = start_connect(to);
  ASSERT_GE(fd, 0);
  pollfd p{fd, POLLOUT, 0};
  (void)::poll(&p, 1, 2000);
  if (!bytes.empty()) (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  if (reset) {
    const linger l{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  }
  ::close(fd);
}

std::string crafted_length_header(std::uint64_t length) {
  std::string b(9, '\0');
  for (unsigned i = 0; i < 8; ++i) b[i] = static_cast<char>((length >> (8U * i)) & 0xFFU);
  b.append(2071, 'A');
  return b;
}

class Ports : public ::testing::TestWithParam<Target> {
 protected:
  void SetUp() override {
#ifndef NETIO3_PERF
    GTEST_SKIP() << "netio3-perf is not built (NETIO3_BUILD_TOOLS=OFF)";
#endif
    if (!Netio3Backend::is_available(GetParam().type)) {
      GTEST_SKIP() << to_string(GetParam().type) << " backend not built";
    }
  }

  // netio3-perf --server under `ulimit_args` (e.g. "-Sn 1024"); returns once it listens.
  std::unique_ptr<ChildProcess> start_server(const std::string& ulimit_args,
                                             const std::string& log_level = "warn") {
#ifdef NETIO3_PERF
    // The log goes to a file: a flood makes the server log a line per connection, and a pipe
    // that nobody reads while the test holds its connections would block the server.
    std::array<char, 64> path{"/tmp/netio3-ports-XXXXXX"};
    const int log_fd = ::mkstemp(path.data());
    if (log_fd < 0) return nullptr;
    ::close(log_fd);
    m_log_path = path.data();
    auto server = std::make_unique<ChildProcess>(std::vector<std::string>{
        "sh", "-c",
        fmt::format("ulimit {} && {} NETIO3_LOG_LEVEL={} UCX_LOG_LEVEL=fatal exec {} --server "
                    "--backend {} --mode {} --bind 127.0.0.1 --port 0{} 2>{}",
                    ulimit_args, GetParam().environment, log_level, NETIO3_PERF,
                    to_string(GetParam().type), to_string(GetParam().mode),
                    GetParam().partition_key.empty()
                        ? std::string{}
                        : fmt::format(" --partition-key '{}'", GetParam().partition_key),
                    m_log_path)});
    constexpr std::string_view LISTENING = "listening on 127.0.0.1:";
    const auto port_line = [&](const std::string& out) {
      const auto at = out.find(LISTENING);
      return at != std::string::npos && out.find('\n', at) != std::string::npos;
    };
    EXPECT_TRUE(server->read_until(port_line, Clock::now() + 30s)) << server->out() << server_log();
    if (!port_line(server->out())) return nullptr;
    m_port = static_cast<std::uint16_t>(
        std::stoul(server->out().substr(server->out().find(LISTENING) + LISTENING.size())));
    return server;
#else
    (void)ulimit_args;
    (void)log_level;
    return nullptr;
#endif
  }

  // A netio3-perf client moves data to the server and says every message arrived intact.
  void expect_service() {
#ifdef NETIO3_PERF
    std::vector<std::string> args{NETIO3_PERF,
                                  "--client",
                                  fmt::format("127.0.0.1:{}", m_port),
                                  "--backend",
                                  std::string{to_string(GetParam().type)},
                                  "--mode",
                                  std::string{to_string(GetParam().mode)},
                                  "--duration",
                                  "1",
                                  "--size",
                                  "4k",
                                  "--quiet"};
    if (!GetParam().partition_key.empty()) {
      args.emplace_back("--partition-key");
      args.emplace_back(GetParam().partition_key);
    }
    ChildProcess client{args};
    const auto status = client.wait(Clock::now() + 60s);
    EXPECT_EQ(status, 0) << client.out() << client.err() << "\nthe server's log:\n" << server_log();
#endif
  }

  void TearDown() override {
    if (!m_log_path.empty()) ::unlink(m_log_path.c_str());
  }

  // What the server logged so far.
  [[nodiscard]] std::string server_log() const {
    std::ifstream file{m_log_path};
    return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
  }

  std::uint16_t m_port{0};
  std::string m_log_path;
};

TEST_P(Ports, EveryListeningSocketSurvivesHostileBytesAndAFloodAndServesAfter) {
  constexpr std::size_t FLOOD = 1100;
  const DescriptorLimit ours{FLOOD + 1024};
  ASSERT_GE(ours.have(), FLOOD + 100) << "this test process cannot open " << FLOOD << " sockets";
  const auto server = start_server("-Sn 1024");
  ASSERT_NE(server, nullptr);
  const pid_t pid = server->pid();
  const auto ports = listening_sockets(pid);
  ASSERT_FALSE(ports.empty());
  const long baseline = open_descriptors(pid);
  ASSERT_GT(baseline, 0);
  std::string list;
  for (const auto& p : ports) list += " " + to_string(p);
  std::printf("[ ports    ] %s listens on%s\n", target_name({GetParam(), 0}).c_str(), list.c_str());
  for (const auto& p : ports) {
    EXPECT_EQ(p.address, "127.0.0.1") << "a socket of the process listens on " << p
                                      << ", but netio3 was asked to listen on 127.0.0.1 only";
  }
  for (const auto& port : ports) {
    if (port.address != "127.0.0.1") continue;
    SCOPED_TRACE(to_string(port));
    const std::vector<std::string> payloads{
        std::string(4096, '\xFF'),
        crafted_length_header(15),
        crafted_length_header(31),
        "GET / HTTP/1.1\r\nHost: readout\r\n\r\n",
        std::string{"NIO3\x03\x00", 6},
        std::string{"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11} + std::string(60, 'x'),
    };
    for (const auto& bytes : payloads) {
      ASSERT_NO_FATAL_FAILURE(send_and_close(port, bytes, false));
      ASSERT_NO_FATAL_FAILURE(send_and_close(port, bytes, true));
    }
    std::vector<int> held;
    for (std::size_t i = 0; i < FLOOD; ++i) {
      const int fd = start_connect(port);
      ASSERT_GE(fd, 0) << "connection " << i;
      held.push_back(fd);
    }
    EXPECT_FALSE(eventually([&] { return !alive(pid); }, 3s));
    ASSERT_TRUE(alive(pid)) << "the server died while " << FLOOD << " connections were held on "
                            << port << "\n"
                            << server_log();
    for (const int fd : held) ::close(fd);
    EXPECT_TRUE(alive(pid)) << server_log();
    // The server drains what the flood left (its accept queue, connections it must see end)
    // before the next port's flood and the client: a slow build (TSan) takes seconds for it,
    // and a client queued behind 1100 closed connections would not be greeted in time.
    EXPECT_TRUE(eventually([&] { return open_descriptors(pid) <= baseline + 8; }, 60s))
        << "the server still holds " << open_descriptors(pid) << " descriptors (" << baseline
        << " before the flood)\n"
        << server_log();
  }
  expect_service();
  EXPECT_TRUE(alive(pid)) << server_log();
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait(Clock::now() + 30s), 0) << server_log();
}

class PortsAtTheLimit : public Ports {};

TEST_P(PortsAtTheLimit, TheListenerPausesLogsOnceAndRecovers) {
  constexpr std::size_t HELD = 300;
  const DescriptorLimit ours{HELD + 1024};
  // NETIO3_LOG_LEVEL=info: the warning, and the line that says accepting works again.
  const auto server = start_server("-n 80", "info");
  ASSERT_NE(server, nullptr);
  const pid_t pid = server->pid();
  const EndPointAddress port{"127.0.0.1", m_port};
  std::vector<int> held;
  for (std::size_t i = 0; i < HELD; ++i) {
    const int fd = start_connect(port);
    ASSERT_GE(fd, 0);
    held.push_back(fd);
  }
  // The accepts run into the limit: the warning (the log file has no one to notify us).
  ASSERT_TRUE(
      eventually([&] { return server_log().find("pausing accepts") != std::string::npos; }, 30s))
      << "the descriptor limit was never reported\n"
      << server_log();
  // Then 4 s of held connections: under the default connect_timeout of 10 s none of the
  // accepted ones times out meanwhile, so this is one exhaustion episode.
  const auto cpu_before = cpu_time(pid);
  const auto begin = Clock::now();
  EXPECT_FALSE(eventually([&] { return !alive(pid); }, 4s)) << server_log();
  const auto window = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - begin);
  const double share = static_cast<double>((cpu_time(pid) - cpu_before).count()) /
                       static_cast<double>(window.count());
  const std::string log = server_log();
  for (const int fd : held) ::close(fd);
  std::size_t warnings = 0;
  for (auto at = log.find("pausing accepts"); at != std::string::npos;
       at = log.find("pausing accepts", at + 1)) {
    ++warnings;
  }
  std::printf(
      "[ limit    ] %s, ulimit -n 80, %zu connections held 4 s: %.1f%% of a core, %zu "
      "warning(s)\n",
      target_name({GetParam(), 0}).c_str(), HELD, 100.0 * share, warnings);
  EXPECT_LT(share, 0.10) << "the server spins at the descriptor limit";
  EXPECT_EQ(warnings, 1U) << log;
  expect_service();
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait(Clock::now() + 30s), 0) << server_log();
}

// ucx_tcp_budget0: UCX's progress stops after every call as when its time budget runs out
// (a loaded machine). The loop then armed the worker although UCX had more to do: the
// connections UCX's listener had accepted (the server has no endpoint yet) stayed unread
// until something else woke the loop - seen in CI under load, every time with this budget.
INSTANTIATE_TEST_SUITE_P(
    Servers, Ports,
    ::testing::Values(
        Target{BackendType::ASYNCMSG, NetworkMode::TCP},
        Target{BackendType::LIBFABRIC, NetworkMode::TCP},
        Target{BackendType::UCX, NetworkMode::TCP}, Target{BackendType::UCX, NetworkMode::RDMA},
        Target{BackendType::UCX, NetworkMode::TCP, "NETIO3_UCX_PROGRESS_BUDGET_US=0", "_budget0"},
        Target{BackendType::ASYNCMSG, NetworkMode::TCP, "", "_keyed",
               "hostile-suite-partition-key"},
        Target{BackendType::UCX, NetworkMode::TCP, "", "_keyed", "hostile-suite-partition-key"},
        Target{BackendType::UCX, NetworkMode::RDMA, "", "_keyed", "hostile-suite-partition-key"},
        Target{BackendType::LIBFABRIC, NetworkMode::TCP, "", "_keyed",
               "hostile-suite-partition-key"}),
    target_name);
INSTANTIATE_TEST_SUITE_P(Servers, PortsAtTheLimit,
                         ::testing::Values(Target{BackendType::ASYNCMSG, NetworkMode::TCP},
                                           Target{BackendType::ASYNCMSG, NetworkMode::TCP, "",
                                                  "_keyed", "hostile-suite-partition-key"},
                                           Target{BackendType::LIBFABRIC, NetworkMode::TCP},
                                           Target{BackendType::LIBFABRIC, NetworkMode::TCP, "",
                                                  "_keyed", "hostile-suite-partition-key"},
                                           Target{BackendType::UCX, NetworkMode::TCP},
                                           Target{BackendType::UCX, NetworkMode::RDMA}),
                         target_name);

}  // namespace
}  // namespace netio3::test
