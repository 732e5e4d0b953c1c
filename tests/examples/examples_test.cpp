// Runs the documentation examples and netio3-demo (examples/) as child processes and
// checks that they do what the documentation says: their output, read through pipes with
// poll() and a deadline, and their exit status. A child that runs past its deadline is
// killed; no child outlives its test.

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
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

// ---- README.md and the user guide (docs/guide.md) --------------------------------------

TEST_P(OnBackend, ReadmeProgramSendsHelloToItself) {
  Child child{{EXAMPLE_README, GetParam()}};
  ASSERT_EQ(child.wait(), 0) << child.describe();
  EXPECT_EQ(child.out(), "received \"hello\"\n") << child.describe();
}

TEST(Examples, ReadmeProgramRejectsAnUnknownBackend) {
  Child child{{EXAMPLE_README, "carrier-pigeon"}};
  EXPECT_EQ(child.wait(), 2) << child.describe();
  EXPECT_THAT(child.err(), HasSubstr("usage:")) << child.describe();
}

// The receiver's "REMOTE: N messages in order" lines, as the numbers N (sorted).
std::vector<std::uint64_t> in_order_counts(const std::string& out) {
  std::vector<std::uint64_t> counts;
  for (const auto& line : lines_of(out)) {
    if (!line.ends_with(" messages in order")) continue;
    const auto n = number_after(line, ": ");
    if (n) counts.push_back(std::stoull(*n));
  }
  std::sort(counts.begin(), counts.end());
  return counts;
}

// Two senders of the first program into one receiver: one whose window (4096 slots) is
// larger than any backend accepts at once, so that it meets NO_RESOURCES and is called back
// by on_ready_to_send_cb; one with 4 slots, which waits for its own completions. The
// receiver tells them apart (on_data_from_cb) and checks each one's order.
TEST_P(OnBackend, GuideFirstProgramTwoSendersArriveWholeAndInOrder) {
  Child receiver{with_backend({EXAMPLE_GUIDE_RECEIVER, "--senders", "2"})};
  const std::string port = start_receiver(receiver);
  ASSERT_FALSE(port.empty()) << receiver.describe();
  Child wide{with_backend(
      {EXAMPLE_GUIDE_SENDER, "--port", port, "--messages", "20000", "--slots", "4096"})};
  Child narrow{
      with_backend({EXAMPLE_GUIDE_SENDER, "--port", port, "--messages", "5000", "--slots", "4"})};
  ASSERT_EQ(wide.wait(), 0) << wide.describe();
  ASSERT_EQ(narrow.wait(), 0) << narrow.describe();
  ASSERT_EQ(receiver.wait(), 0) << receiver.describe();
  EXPECT_EQ(in_order_counts(receiver.out()), (std::vector<std::uint64_t>{5000, 20000}))
      << receiver.describe();
  EXPECT_EQ(count_lines_starting_with(receiver.out(), "127.0.0.1:"), 4U)
      << "2 connected, 2 counted: " << receiver.describe();
  EXPECT_THAT(wide.out(), HasSubstr("20000 sent, 20000 completed, 0 cancelled")) << wide.describe();
  const auto ready = number_after(wide.out(), "bytes sent to 127.0.0.1:" + port + " (");
  ASSERT_TRUE(ready.has_value()) << wide.describe();
  EXPECT_GT(std::stoul(*ready), 0U) << "the wide sender was never refused: " << wide.describe();
  EXPECT_THAT(narrow.out(), HasSubstr("5000 sent, 5000 completed, 0 cancelled"))
      << narrow.describe();
}

TEST_P(OnBackend, GuideFirstSenderSaysWhyItWasRefused) {
  const netio3::test::BoundSocket hold{{"127.0.0.1", 0}};
  ASSERT_EQ(hold.error(), "");
  Child sender{with_backend({EXAMPLE_GUIDE_SENDER, "--port", std::to_string(hold.port())})};
  EXPECT_EQ(sender.wait(), 1) << sender.describe();
  EXPECT_THAT(sender.out(), HasSubstr(fmt::format(
                                "connection to 127.0.0.1:{} refused (unreachable): ", hold.port())))
      << sender.describe();
}

// Buffered and copy sends from the application's own thread, into one receiver.
TEST_P(OnBackend, GuideThreadsSendBufferedAndCopiesFromTheirOwnThread) {
  Child receiver{with_backend({EXAMPLE_GUIDE_RECEIVER, "--senders", "2"})};
  const std::string port = start_receiver(receiver);
  ASSERT_FALSE(port.empty()) << receiver.describe();
  Child buffered{with_backend(
      {EXAMPLE_GUIDE_THREADS, "--port", port, "--send", "buffered", "--messages", "20000"})};
  Child copies{with_backend(
      {EXAMPLE_GUIDE_THREADS, "--port", port, "--send", "copy", "--messages", "10000"})};
  ASSERT_EQ(buffered.wait(), 0) << buffered.describe();
  ASSERT_EQ(copies.wait(), 0) << copies.describe();
  ASSERT_EQ(receiver.wait(), 0) << receiver.describe();
  EXPECT_EQ(in_order_counts(receiver.out()), (std::vector<std::uint64_t>{10000, 20000}))
      << receiver.describe();
  EXPECT_THAT(buffered.out(), HasSubstr("OK: 20000 messages sent buffered, 20000 completed, 0 "
                                        "cancelled"))
      << buffered.describe();
  if (copy_supported()) {
    EXPECT_THAT(copies.out(), HasSubstr("OK: 10000 messages sent as copies, 10000 completed"))
        << copies.describe();
  } else {
    EXPECT_THAT(copies.out(), HasSubstr("cannot send copies (capabilities.send_copy is false)"))
        << copies.describe();
    EXPECT_THAT(copies.out(), HasSubstr("OK: 10000 messages sent buffered")) << copies.describe();
  }
}

TEST_P(OnBackend, GuideSharedBuffersServeManyConnectionsFromOnePool) {
  Child child{
      with_backend({EXAMPLE_GUIDE_SHARED_BUFFERS, "--connections", "8", "--messages", "3000"})};
  ASSERT_EQ(child.wait(), 0) << child.describe();
  const auto high_water = number_after(child.out(), "at most ");
  ASSERT_TRUE(high_water.has_value()) << child.describe();
  EXPECT_GT(std::stoul(*high_water), 0U) << child.describe();
  EXPECT_LE(std::stoul(*high_water), 32U) << child.describe();
  EXPECT_THAT(child.out(), HasSubstr("OK\n")) << child.describe();
}

TEST_P(OnBackend, GuideErrorsHappenAsDocumented) {
  Child child{with_backend({EXAMPLE_GUIDE_ERRORS})};
  ASSERT_EQ(child.wait(), 0) << child.describe();
  EXPECT_EQ(count_lines_starting_with(child.out(), "WRONG"), 0U) << child.describe();
  EXPECT_EQ(count_lines_starting_with(child.out(), "ok: "), 11U) << child.describe();
  // The exception thrown by on_data_cb was logged, and the backend carried on.
  EXPECT_THAT(child.err(), HasSubstr("exception escaped on_data_cb: the application's own bug"))
      << child.describe();
}

// Timers tick on the loop thread, and Ctrl-C (SIGINT) stops the program cleanly: the
// connection closes, the closed callback stops the loop, exit status 0 (not 1, as the psm
// library's handler would give a program without one of its own).
TEST_P(OnBackend, GuideTimersTickAndCtrlCStopsCleanly) {
  Child child{with_backend({EXAMPLE_GUIDE_TIMERS, "--tick", "50"})};
  // A tick that saw both ends of the connection open and messages received: both timers run.
  // (Parsed by hand: GCC 12's <regex> trips -Wmaybe-uninitialized under ASan.)
  const auto busy_tick = [](const std::string& out) {
    for (const auto& line : lines_of(out)) {
      unsigned long tick = 0, open = 0, sent = 0, completed = 0, received = 0;
      if (std::sscanf(line.c_str(), "tick %lu: %lu open, %lu sent, %lu completed, %lu received",
                      &tick, &open, &sent, &completed, &received) == 5 &&
          open == 2 && received > 0) {
        return true;
      }
    }
    return false;
  };
  ASSERT_TRUE(child.read_until(busy_tick, deadline())) << child.describe();
  child.signal(SIGINT);
  ASSERT_EQ(child.wait(deadline()), 0) << child.describe();
  EXPECT_THAT(child.out(), HasSubstr(fmt::format("stopping (signal {})", SIGINT)))
      << child.describe();
  EXPECT_THAT(child.out(), HasSubstr("closed: ")) << child.describe();
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
