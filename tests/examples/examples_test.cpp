// Runs the documentation examples and netio3-demo (examples/) as child processes and
// checks that they do what the documentation says: their output, read through pipes with
// poll() and a deadline, and their exit status. A child that runs past its deadline is
// killed; no child outlives its test.

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/wait.h>
#include <tuple>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_support.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using ::testing::HasSubstr;

// Generous: a sanitizer build on a loaded two-core machine is slow. Passing tests never
// get near it.
constexpr auto CHILD_TIMEOUT = 60s;

// A child process with its stdout and stderr on pipes; killed and reaped at the latest when
// it goes out of scope.
using Child = netio3::test::ChildProcess;

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in{text};
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::size_t count_lines_starting_with(const std::string& text, std::string_view prefix) {
  const auto lines = lines_of(text);
  return static_cast<std::size_t>(
      std::count_if(lines.begin(), lines.end(),
                    [&](const std::string& line) { return line.starts_with(prefix); }));
}

// The number (digits and dots) that follows the first `prefix` in `text`, after optional
// spaces; nullopt if there is none or it runs to the end of `text` (the line may still be
// arriving).
std::optional<std::string> number_after(std::string_view text, std::string_view prefix) {
  const auto at = text.find(prefix);
  if (at == std::string_view::npos) return std::nullopt;
  std::size_t i = at + prefix.size();
  while (i < text.size() && text[i] == ' ') ++i;
  const std::size_t start = i;
  while (i < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[i])) != 0 || text[i] == '.'))
    ++i;
  if (i == start || i == text.size()) return std::nullopt;
  return std::string{text.substr(start, i - start)};
}

Clock::time_point deadline() {
  return Clock::now() + CHILD_TIMEOUT;
}

// The examples on every backend compiled in. The examples keep the documented
// NetworkMode::RDMA, which for libfabric means verbs; this machine has no RDMA device, so
// the libfabric runs use the documented override FI_PROVIDER=tcp.
std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto type : netio3::Netio3Backend::available()) {
    names.emplace_back(netio3::to_string(type));
  }
  return names;
}

class OnBackend : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "libfabric") ::setenv("FI_PROVIDER", "tcp", 1);
  }
  void TearDown() override { ::unsetenv("FI_PROVIDER"); }
  [[nodiscard]] std::vector<std::string> with_backend(std::vector<std::string> argv) const {
    argv.emplace_back("--backend");
    argv.push_back(GetParam());
    return argv;
  }
  // The documentation: immediate sending "is not supported for RDMA" (libfabric). UCX
  // supports it (docs/ucx.md).
  [[nodiscard]] bool copy_supported() const { return GetParam() != "libfabric"; }
};

// ---- Creating a backend instance -------------------------------------------------------

TEST(Examples, CreateBackendWithRdmaModeUsesTcpOnAsyncmsg) {
  Child child{{EXAMPLE_CREATE_BACKEND}};
  ASSERT_EQ(child.wait(), 0) << child.describe();
  EXPECT_THAT(child.out(), HasSubstr("Created the asyncmsg backend with NetworkMode::RDMA"))
      << child.describe();
  EXPECT_THAT(child.out(),
              HasSubstr("asyncmsg uses TCP although NetworkMode::RDMA was passed: a plain TCP "
                        "socket connected to its listen endpoint 127.0.0.1:"))
      << child.describe();
}

TEST(Examples, ExamplesRejectAnUnknownBackendName) {
  for (const char* program : {EXAMPLE_CREATE_BACKEND, EXAMPLE_CONNECT, NETIO3_DEMO}) {
    Child child{{program, "--backend", "carrier-pigeon"}};
    EXPECT_EQ(child.wait(), 2) << child.describe();
    EXPECT_THAT(child.err(), HasSubstr("unknown backend 'carrier-pigeon'")) << child.describe();
  }
}

// ---- Opening a connection --------------------------------------------------------------

TEST_P(OnBackend, ConnectIsEstablishedForBothSidesAndRefusedOnAnUnusedPort) {
  Child child{with_backend({EXAMPLE_CONNECT})};
  ASSERT_EQ(child.wait(), 0) << child.describe();
  EXPECT_EQ(count_lines_starting_with(child.out(), "Connection established with 127.0.0.1:"), 2U)
      << child.describe();
  EXPECT_EQ(count_lines_starting_with(child.out(), "Connection refused by 127.0.0.1:"), 1U)
      << child.describe();
  EXPECT_EQ(count_lines_starting_with(child.out(), "FAILED"), 0U) << child.describe();
}

// ---- Example: Receiver and Sender ------------------------------------------------------

// Starts the receiver on port 0 and returns the port from its "listening on" line.
std::string start_receiver(Child& receiver) {
  std::optional<std::string> port;
  const bool found = receiver.read_until(
      [&](const std::string& out) {
        port = number_after(out, "listening on 127.0.0.1:");
        return port.has_value();
      },
      deadline());
  if (!found || !port) return {};
  return *port;
}

TEST_P(OnBackend, SenderSendsEveryMessageToTheReceiver) {
  constexpr int MESSAGES = 50;  // more than the sender's 16 buffers: get_buffer runs dry
  Child receiver{
      with_backend({EXAMPLE_RECEIVER, "--port", "0", "--messages", std::to_string(MESSAGES)})};
  const std::string port = start_receiver(receiver);
  ASSERT_FALSE(port.empty()) << receiver.describe();
  ASSERT_NE(port, "0");

  Child sender{
      with_backend({EXAMPLE_SENDER, "--port", port, "--messages", std::to_string(MESSAGES)})};
  ASSERT_EQ(sender.wait(), 0) << sender.describe();
  ASSERT_EQ(receiver.wait(), 0) << receiver.describe();

  EXPECT_EQ(
      count_lines_starting_with(sender.out(), "Connection established with 127.0.0.1:" + port), 1U)
      << sender.describe();
  EXPECT_EQ(
      count_lines_starting_with(sender.out(), "Send operation to 127.0.0.1:" + port + " with key "),
      static_cast<std::size_t>(MESSAGES))
      << sender.describe();
  EXPECT_THAT(sender.out(), HasSubstr(fmt::format("OK: sent {} message(s)", MESSAGES)));
  // Buffered sending: the key is the index of the buffer, one of the sender's 16.
  for (const auto& line : lines_of(sender.out())) {
    if (!line.starts_with("Send operation to ") || !line.ends_with(" completed")) continue;
    const auto key = number_after(line, " with key ");
    ASSERT_TRUE(key.has_value()) << line;
    EXPECT_LT(std::stoul(*key), 16U) << line;
  }

  EXPECT_EQ(count_lines_starting_with(receiver.out(), "Connection established with 127.0.0.1:"), 1U)
      << receiver.describe();
  EXPECT_EQ(count_lines_starting_with(receiver.out(), "Received data of size 17"),
            static_cast<std::size_t>(10))
      << receiver.describe();  // "message 0" .. "message 9": 8 + 9 bytes
  EXPECT_EQ(count_lines_starting_with(receiver.out(), "Received data of size "),
            static_cast<std::size_t>(MESSAGES))
      << receiver.describe();
  // Every message, in order, with its content.
  std::string expected;
  for (int i = 0; i < MESSAGES; ++i)
    expected += fmt::format("  message {}: \"message {}\"\n", i, i);
  std::string got;
  for (const auto& line : lines_of(receiver.out())) {
    if (line.starts_with("  message ")) got += line + "\n";
  }
  EXPECT_EQ(got, expected) << receiver.describe();
  EXPECT_THAT(receiver.out(), HasSubstr(fmt::format("OK: received {} message(s)", MESSAGES)));
}

TEST_P(OnBackend, ReceiverStopsWhenTheSenderCloses) {
  Child receiver{
      with_backend({EXAMPLE_RECEIVER, "--port", "0", "--messages", "0"})};  // 0: no limit
  const std::string port = start_receiver(receiver);
  ASSERT_FALSE(port.empty()) << receiver.describe();

  Child sender{with_backend({EXAMPLE_SENDER, "--port", port, "--messages", "5"})};
  ASSERT_EQ(sender.wait(), 0) << sender.describe();
  ASSERT_EQ(receiver.wait(), 0) << receiver.describe();
  EXPECT_EQ(count_lines_starting_with(receiver.out(), "Received data of size "), 5U)
      << receiver.describe();
  EXPECT_EQ(count_lines_starting_with(receiver.out(), "Connection closed with 127.0.0.1:"), 1U)
      << receiver.describe();
  EXPECT_EQ(count_lines_starting_with(sender.out(), "Connection closed with 127.0.0.1:" + port), 1U)
      << sender.describe();
}

TEST_P(OnBackend, SenderFailsWhenNobodyListens) {
  // Held, not listening: no listener of a test running beside this one can get the port.
  const netio3::test::BoundSocket hold{{"127.0.0.1", 0}};
  ASSERT_EQ(hold.error(), "");
  const auto port = std::to_string(hold.port());
  Child sender{with_backend({EXAMPLE_SENDER, "--port", port, "--messages", "5"})};
  ASSERT_EQ(sender.wait(), 1) << sender.describe();
  EXPECT_EQ(count_lines_starting_with(sender.out(), "Connection refused by 127.0.0.1:" + port), 1U)
      << sender.describe();
  EXPECT_EQ(count_lines_starting_with(sender.out(), "Send operation"), 0U) << sender.describe();
}

TEST_P(OnBackend, ReceiverFailsWhenTheSenderStopsEarly) {
  Child receiver{with_backend({EXAMPLE_RECEIVER, "--port", "0", "--messages", "10"})};
  const std::string port = start_receiver(receiver);
  ASSERT_FALSE(port.empty()) << receiver.describe();
  Child sender{with_backend({EXAMPLE_SENDER, "--port", port, "--messages", "3"})};
  ASSERT_EQ(sender.wait(), 0) << sender.describe();
  EXPECT_EQ(receiver.wait(), 1) << receiver.describe();
  EXPECT_THAT(receiver.out(), HasSubstr("FAILED: 3 message(s) received, 10 expected"))
      << receiver.describe();
}

// ---- Zero-copy and immediate sending ---------------------------------------------------

void expect_one_message_header_then_payload(const Child& child) {
  EXPECT_EQ(count_lines_starting_with(child.out(), "Connection established with 127.0.0.1:"), 2U)
      << child.describe();
  EXPECT_EQ(count_lines_starting_with(child.out(), "Received "), 1U) << child.describe();
  EXPECT_EQ(count_lines_starting_with(child.out(), "Received 3 bytes in one span: 00 01 02"), 1U)
      << child.describe();
  const auto lines = lines_of(child.out());
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [](const std::string& line) {
    return line.starts_with("Send operation to 127.0.0.1:") &&
           line.ends_with(" with key 0 completed");
  })) << child.describe();
  EXPECT_EQ(count_lines_starting_with(child.out(), "Send operation"), 1U) << child.describe();
  EXPECT_THAT(child.out(), HasSubstr("OK: header and payload arrived as one message"));
}

TEST_P(OnBackend, ZeroCopySendDeliversHeaderAndPayloadAsOneSpan) {
  Child child{with_backend({EXAMPLE_ZERO_COPY})};
  ASSERT_EQ(child.wait(), 0) << child.describe();
  expect_one_message_header_then_payload(child);
  EXPECT_THAT(child.out(), HasSubstr("send_data(127.0.0.1:"));
}

TEST_P(OnBackend, CopySendDeliversHeaderAndPayloadAsOneSpan) {
  Child child{with_backend({EXAMPLE_COPY_SEND})};
  if (!copy_supported()) {
    EXPECT_NE(child.wait(), 0) << child.describe();
    EXPECT_THAT(child.out() + child.err(), HasSubstr("send_data_copy is not supported"))
        << child.describe();
    return;
  }
  ASSERT_EQ(child.wait(), 0) << child.describe();
  expect_one_message_header_then_payload(child);
  EXPECT_THAT(child.out(), HasSubstr("send_data_copy(127.0.0.1:"));
}

// ---- netio3-demo -----------------------------------------------------------------------

class DemoTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    if (std::get<0>(GetParam()) == "libfabric") ::setenv("FI_PROVIDER", "tcp", 1);
  }
  void TearDown() override { ::unsetenv("FI_PROVIDER"); }
};

TEST_P(DemoTest, MovesDataIntactAndReportsTheRate) {
  const auto& [backend, mode] = GetParam();
  Child child{{NETIO3_DEMO, "--seconds", "1", "--send", mode, "--backend", backend}};
  if (mode == "copy" && backend == "libfabric") {
    EXPECT_NE(child.wait(), 0) << child.describe();
    EXPECT_THAT(child.out() + child.err(), HasSubstr("send_data_copy is not supported"))
        << child.describe();
    return;
  }
  ASSERT_EQ(child.wait(), 0) << child.describe();
  const std::string& out = child.out();
  const auto mb_per_s = number_after(out, "rate:");
  const auto gbit_per_s = number_after(out, " MB/s, ");
  const auto msg_per_s = number_after(out, " Gbit/s, ");
  const auto sent_count = number_after(out, "sent:");
  ASSERT_TRUE(mb_per_s && gbit_per_s && msg_per_s && sent_count) << child.describe();
  EXPECT_GT(std::stod(*mb_per_s), 0.0) << child.describe();
  EXPECT_GT(std::stod(*gbit_per_s), 0.0) << child.describe();
  EXPECT_GT(std::stod(*msg_per_s), 0.0) << child.describe();
  const std::string sent = *sent_count;
  EXPECT_THAT(out, HasSubstr(fmt::format("received: {} messages, {} bytes", sent,
                                         std::stoull(sent) * 4096)))
      << child.describe();
  EXPECT_THAT(out, HasSubstr(mode + " sends of 4096-byte messages")) << child.describe();
  EXPECT_THAT(out, HasSubstr("result:   OK, every message arrived intact and in order"))
      << child.describe();
}

INSTANTIATE_TEST_SUITE_P(BackendsAndSendModes, DemoTest,
                         ::testing::Combine(::testing::ValuesIn(backend_names()),
                                            ::testing::Values("buffered", "zero-copy", "copy")),
                         [](const auto& param_info) {
                           std::string name =
                               std::get<0>(param_info.param) + "_" + std::get<1>(param_info.param);
                           std::erase(name, '-');
                           return name;
                         });

INSTANTIATE_TEST_SUITE_P(Examples, OnBackend, ::testing::ValuesIn(backend_names()),
                         [](const auto& param_info) { return param_info.param; });

TEST(Demo, SmallAndLargeMessages) {
  for (const char* size : {"8", "100000"}) {
    Child child{{NETIO3_DEMO, "--seconds", "0.3", "--send", "zero-copy", "--size", size}};
    EXPECT_EQ(child.wait(), 0) << child.describe();
    EXPECT_THAT(child.out(), HasSubstr("result:   OK")) << child.describe();
  }
}

TEST(Demo, RejectsBadOptions) {
  for (const auto& args : std::vector<std::vector<std::string>>{{"--send", "telepathy"},
                                                                {"--size", "7"},
                                                                {"--seconds", "0"},
                                                                {"--size", "lots"},
                                                                {"--colour", "blue"}}) {
    std::vector<std::string> argv{NETIO3_DEMO};
    argv.insert(argv.end(), args.begin(), args.end());
    Child child{argv};
    EXPECT_EQ(child.wait(), 2) << child.describe();
  }
}

TEST(ChildProcess, IsKilledAtTheDeadline) {
  // The driver's own safety net: a receiver that waits for a sender that never comes is
  // killed when the deadline passes, and reaped.
  Child receiver{{EXAMPLE_RECEIVER, "--port", "0", "--messages", "1", "--timeout", "600"}};
  ASSERT_FALSE(start_receiver(receiver).empty()) << receiver.describe();
  const auto start = Clock::now();
  EXPECT_EQ(receiver.wait(Clock::now() + 200ms), std::nullopt) << receiver.describe();
  EXPECT_LT(Clock::now() - start, 10s);
  // Reaped: no child with that pid is left to wait for.
  EXPECT_EQ(::waitpid(receiver.pid(), nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
}

}  // namespace
