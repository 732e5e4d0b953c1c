// Runs the documentation examples and netio3-demo (examples/) as child processes and
// checks that they do what the documentation says: their output, read through pipes with
// poll() and a deadline, and their exit status. A child that runs past its deadline is
// killed; no child outlives its test.

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <netinet/in.h>
#include <optional>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <system_error>
#include <tuple>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_support.hpp"

extern char** environ;  // NOLINT: POSIX

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using ::testing::HasSubstr;

// Generous: a sanitizer build on a loaded two-core machine is slow. Passing tests never
// get near it.
constexpr auto CHILD_TIMEOUT = 60s;

[[noreturn]] void throw_errno(std::string_view what) {
  throw std::system_error(errno, std::generic_category(), std::string{what});
}

// A child process with its stdout and stderr on pipes. The destructor kills and reaps a
// child that is still running.
class Child {
 public:
  explicit Child(std::vector<std::string> args) : m_args{std::move(args)} {
    std::array<int, 2> out{-1, -1};
    std::array<int, 2> err{-1, -1};
    if (::pipe2(out.data(), O_CLOEXEC) != 0) throw_errno("pipe2");
    if (::pipe2(err.data(), O_CLOEXEC) != 0) {
      close_all(out);
      throw_errno("pipe2");
    }
    posix_spawn_file_actions_t actions{};
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);  // dup2 clears O_CLOEXEC
    posix_spawn_file_actions_adddup2(&actions, err[1], 2);
    std::vector<char*> argv;
    argv.reserve(m_args.size() + 1);
    for (auto& arg : m_args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&m_pid, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    ::close(err[1]);
    if (rc != 0) {
      ::close(out[0]);
      ::close(err[0]);
      throw std::system_error(rc, std::generic_category(), "posix_spawn " + m_args[0]);
    }
    m_out.fd = out[0];
    m_err.fd = err[0];
    // A pidfd becomes readable when the child exits, so poll() can wait for the exit too.
    m_pidfd = static_cast<int>(::syscall(SYS_pidfd_open, m_pid, 0));
    if (m_pidfd < 0) {
      kill_and_reap();
      throw_errno("pidfd_open");
    }
  }

  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  Child(Child&&) = delete;
  Child& operator=(Child&&) = delete;

  ~Child() {
    kill_and_reap();
    for (const int fd : {m_out.fd, m_err.fd, m_pidfd}) {
      if (fd >= 0) ::close(fd);
    }
  }

  // Reads output until pred(stdout so far) holds; false if the child closed stdout or the
  // deadline passed first.
  bool read_until(const std::function<bool(const std::string&)>& pred, Clock::time_point deadline) {
    while (!pred(m_out.text)) {
      if (m_out.fd < 0 || Clock::now() >= deadline) return false;
      pump(deadline);
    }
    return true;
  }

  // Reads all output and waits for the exit; kills the child at the deadline. Returns the
  // exit status, or nullopt if the child was killed or died from a signal.
  std::optional<int> wait(Clock::time_point deadline) {
    while (m_out.fd >= 0 || m_err.fd >= 0 || !m_exited) {
      if (Clock::now() >= deadline) {
        m_timed_out = true;
        kill_and_reap();
        return std::nullopt;
      }
      pump(deadline);
    }
    if (WIFEXITED(m_status)) return WEXITSTATUS(m_status);
    return std::nullopt;
  }

  std::optional<int> wait() { return wait(Clock::now() + CHILD_TIMEOUT); }

  [[nodiscard]] const std::string& out() const { return m_out.text; }
  [[nodiscard]] const std::string& err() const { return m_err.text; }
  [[nodiscard]] pid_t pid() const { return m_pid; }

  // For failure messages.
  [[nodiscard]] std::string describe() const {
    std::ostringstream s;
    s << "command:";
    for (const auto& arg : m_args) s << ' ' << arg;
    s << "\nstatus: ";
    if (m_timed_out) {
      s << "killed after the deadline";
    } else if (!m_exited) {
      s << "running";
    } else if (WIFEXITED(m_status)) {
      s << "exit " << WEXITSTATUS(m_status);
    } else if (WIFSIGNALED(m_status)) {
      s << "signal " << WTERMSIG(m_status);
    }
    s << "\n--- stdout ---\n" << m_out.text << "--- stderr ---\n" << m_err.text << "---";
    return s.str();
  }

 private:
  struct Stream {
    int fd{-1};
    std::string text;
  };

  static void close_all(std::array<int, 2>& fds) {
    for (const int fd : fds) ::close(fd);
  }

  // One poll() round: reads what is there, notices EOF and the exit.
  void pump(Clock::time_point deadline) {
    std::array<pollfd, 3> fds{};
    std::array<Stream*, 3> streams{};
    nfds_t n = 0;
    for (Stream* stream : {&m_out, &m_err}) {
      if (stream->fd < 0) continue;
      fds.at(n) = pollfd{.fd = stream->fd, .events = POLLIN, .revents = 0};
      streams.at(n++) = stream;
    }
    if (!m_exited) fds.at(n++) = pollfd{.fd = m_pidfd, .events = POLLIN, .revents = 0};
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    const int timeout_ms = static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 60'000));
    const int rc = ::poll(fds.data(), n, timeout_ms);
    if (rc < 0) {
      if (errno == EINTR) return;
      throw_errno("poll");
    }
    for (nfds_t i = 0; i < n; ++i) {
      if (fds.at(i).revents == 0) continue;
      if (streams.at(i) == nullptr) {
        reap(0);
        continue;
      }
      Stream& stream = *streams.at(i);
      std::array<char, 4096> buffer{};
      const ssize_t got = ::read(stream.fd, buffer.data(), buffer.size());
      if (got > 0) {
        stream.text.append(buffer.data(), static_cast<std::size_t>(got));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        ::close(stream.fd);
        stream.fd = -1;
      }
    }
  }

  void reap(int options) {
    if (m_exited) return;
    int status = 0;
    const pid_t rc = ::waitpid(m_pid, &status, options);
    if (rc == m_pid) {
      m_exited = true;
      m_status = status;
    }
  }

  void kill_and_reap() {
    if (m_exited || m_pid <= 0) return;
    ::kill(m_pid, SIGKILL);
    reap(0);  // SIGKILL cannot be ignored: this returns at once
  }

  std::vector<std::string> m_args;
  pid_t m_pid{-1};
  int m_pidfd{-1};
  Stream m_out;
  Stream m_err;
  bool m_exited{false};
  bool m_timed_out{false};
  int m_status{0};
};

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
  const auto port = std::to_string(netio3::test::unused_port());
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
