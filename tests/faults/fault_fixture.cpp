#include "fault_fixture.hpp"

#include <array>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

namespace netio3::faults {

std::vector<BackendType> backends() {
  return Netio3Backend::available();
}

std::string name_of(BackendType type) {
  return std::string{netio3::to_string(type)};
}

ProviderEnvironment::ProviderEnvironment(BackendType type) {
  if (type != BackendType::LIBFABRIC) return;
  if (const char* old = std::getenv("FI_PROVIDER"); old != nullptr) m_saved = old;
  ::setenv("FI_PROVIDER", "tcp", 1);
  m_set = true;
}

ProviderEnvironment::~ProviderEnvironment() {
  if (!m_set) return;
  if (m_saved) {
    ::setenv("FI_PROVIDER", m_saved->c_str(), 1);
  } else {
    ::unsetenv("FI_PROVIDER");
  }
}

Side::Side(BackendType type, std::size_t message_size,
           const std::function<void(NetworkConfig&)>& tweak, NetworkMode network)
    : observer{message_size} {
  auto config = observer.config(network);
  if (tweak) tweak(config);
  backend = Netio3Backend::create(type, std::move(config), loop.loop());
}

Side::~Side() {
  backend.reset();
}

std::optional<Clock::time_point> Side::wait_closed(const EndPointAddress& remote,
                                                   Clock::time_point deadline) {
  std::optional<Clock::time_point> at;
  observer.wait(
      [&](const Observer& o) {
        const ConnectionState* conn = o.connection(remote);
        if (conn != nullptr && conn->closed) at = conn->closed_at;
        return at.has_value();
      },
      deadline);
  return at;
}

// Runs a command to its end; "" on success, else what went wrong.
std::string run_command(const std::vector<std::string>& argv) {
  try {
    ChildProcess child{argv};
    if (child.wait(Clock::now() + WAIT) == 0) return {};
    return fmt::format("`{}` failed\n{}", fmt::join(argv, " "), child.describe());
  } catch (const std::exception& e) {
    return fmt::format("`{}`: {}", fmt::join(argv, " "), e.what());
  }
}

namespace {

// Waits until an interface of a namespace is operationally up (by asking `ip`, until a
// deadline); "" when it is, else why not.
std::string wait_running(const std::string& ns, const std::string& dev) {
  const auto deadline = Clock::now() + WAIT;
  const std::vector<std::string> argv{"ip", "-n", ns, "-o", "link", "show", "dev", dev};
  while (Clock::now() < deadline) {
    ChildProcess ip{argv};
    if (ip.wait(deadline) != 0) {
      return fmt::format("`{}` failed\n{}", fmt::join(argv, " "), ip.describe());
    }
    if (ip.out().find(" state UP ") != std::string::npos) return {};
  }
  return fmt::format("{} in {} did not come up within {} s", dev, ns,
                     test::DEFAULT_TIMEOUT.count() / 1000);
}

}  // namespace

NamespacePair::NamespacePair() {
  if (::geteuid() != 0) {
    m_why = "network namespaces need root";
    return;
  }
  static std::atomic<int> counter{0};
  const int pid = ::getpid();
  const int n = counter++;
  ns_a = fmt::format("n3a-{}-{}", pid, n);
  ns_b = fmt::format("n3b-{}-{}", pid, n);
  veth_a = fmt::format("n3va{}k{}", pid, n);
  veth_b = fmt::format("n3vb{}k{}", pid, n);
  const int x = (pid >> 8) & 0xff;
  const int y = pid & 0xff;
  ip_a = fmt::format("10.{}.{}.1", x, y);
  ip_b = fmt::format("10.{}.{}.2", x, y);
  m_why = run_command({"ip", "netns", "add", ns_a});
  if (!m_why.empty()) return;
  m_created_a = true;
  m_why = run_command({"ip", "netns", "add", ns_b});
  if (!m_why.empty()) return;
  m_created_b = true;
  for (const auto& argv : std::vector<std::vector<std::string>>{
           {"ip", "-n", ns_a, "link", "add", veth_a, "type", "veth", "peer", "name", veth_b,
            "netns", ns_b},
           {"ip", "-n", ns_a, "addr", "add", ip_a + "/24", "dev", veth_a},
           {"ip", "-n", ns_b, "addr", "add", ip_b + "/24", "dev", veth_b},
           {"ip", "-n", ns_a, "link", "set", "lo", "up"},
           {"ip", "-n", ns_b, "link", "set", "lo", "up"},
           {"ip", "-n", ns_a, "link", "set", veth_a, "up"},
           {"ip", "-n", ns_b, "link", "set", veth_b, "up"}}) {
    m_why = run_command(argv);
    if (!m_why.empty()) return;
  }
  // The carrier is up at once, the operational state follows through the kernel's link
  // watch a little later; UCX only uses interfaces that are running when it starts.
  for (const auto& [ns, veth] : {std::pair{ns_a, veth_a}, std::pair{ns_b, veth_b}}) {
    m_why = wait_running(ns, veth);
    if (!m_why.empty()) return;
  }
}

NamespacePair::~NamespacePair() {
  for (const auto& [created, ns] : {std::pair{m_created_a, ns_a}, std::pair{m_created_b, ns_b}}) {
    if (!created) continue;
    const std::string error = run_command({"ip", "netns", "del", ns});
    if (!error.empty()) ADD_FAILURE() << "namespace left behind: " << error;
  }
}

std::string NamespacePair::cut() const {
  return run_command({"ip", "-n", ns_a, "link", "set", veth_a, "down"});
}

std::string NamespacePair::restore() const {
  if (auto error = run_command({"ip", "-n", ns_a, "link", "set", veth_a, "up"}); !error.empty()) {
    return error;
  }
  return wait_running(ns_a, veth_a);
}

std::vector<std::string> peer_command(const PeerOptions& o, const std::string& netns) {
  std::vector<std::string> argv;
  if (!netns.empty()) argv = {"ip", "netns", "exec", netns};
  argv.insert(argv.end(), o.prefix.begin(), o.prefix.end());
  if (!o.environment.empty()) {
    argv.emplace_back("env");
    argv.insert(argv.end(), o.environment.begin(), o.environment.end());
  }
  const std::vector<std::string> rest{
      NETIO3_FAULT_PEER,
      "--backend",
      name_of(o.backend),
      "--role",
      o.send ? "send" : "recv",
      o.listen ? "--listen" : "--connect",
      o.listen ? *o.listen : fmt::format("{}:{}", o.connect->address, o.connect->port),
      "--messages",
      std::to_string(o.messages),
      "--size",
      std::to_string(o.size),
      "--mode",
      std::string{to_string(o.mode)},
      "--network",
      std::string{netio3::to_string(o.network)},
      "--stream",
      std::to_string(o.stream),
      "--progress",
      std::to_string(o.progress),
      "--timeout",
      std::to_string(o.timeout.count())};
  argv.insert(argv.end(), rest.begin(), rest.end());
  if (o.peer_timeout) {
    argv.emplace_back("--peer-timeout-ms");
    argv.push_back(std::to_string(o.peer_timeout->count()));
  }
  if (o.undumpable) {
    argv.emplace_back("--undumpable");
    argv.emplace_back("1");
  }
  if (o.port != 0) {
    argv.emplace_back("--port");
    argv.push_back(std::to_string(o.port));
  }
  if (o.rate != 0) {
    argv.emplace_back("--rate");
    argv.push_back(std::to_string(o.rate));
  }
  if (o.session) {
    for (const auto& arg :
         {std::string{"--session"}, std::string{"1"}, std::string{"--session-max-delay-ms"},
          std::to_string(o.session_max_delay.count()), std::string{"--give-up-ms"},
          std::to_string(o.give_up.count())}) {
      argv.push_back(arg);
    }
  }
  return argv;
}

namespace {

std::vector<std::string_view> complete_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  std::size_t start = 0;
  for (std::size_t nl = text.find('\n'); nl != std::string_view::npos;
       nl = text.find('\n', start)) {
    lines.push_back(text.substr(start, nl - start));
    start = nl + 1;
  }
  return lines;
}

std::optional<std::int64_t> to_number(std::string_view text) {
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end == text.data()) return std::nullopt;
  return value;
}

}  // namespace

std::optional<std::uint64_t> last_number(const std::string& text, std::string_view prefix) {
  std::optional<std::uint64_t> found;
  for (const auto line : complete_lines(text)) {
    if (!line.starts_with(prefix)) continue;
    if (const auto n = to_number(line.substr(prefix.size())); n && *n >= 0) {
      found = static_cast<std::uint64_t>(*n);
    }
  }
  return found;
}

std::optional<std::string> line_starting(const std::string& text, std::string_view prefix) {
  for (const auto line : complete_lines(text)) {
    if (line.starts_with(prefix)) return std::string{line};
  }
  return std::nullopt;
}

bool read_until_both_ended(ChildProcess& receiver, ChildProcess& sender,
                           Clock::time_point deadline) {
  const std::array<ChildProcess*, 2> both{&receiver, &sender};
  return ChildProcess::read_until(
      both,
      [&] {
        return line_starting(sender.out(), "END ").has_value() &&
               line_starting(receiver.out(), "END ").has_value();
      },
      deadline);
}

std::optional<std::int64_t> field(std::string_view line, std::string_view key) {
  const std::string needle = fmt::format(" {}=", key);
  const auto at = line.find(needle);
  if (at == std::string_view::npos) return std::nullopt;
  return to_number(line.substr(at + needle.size()));
}

std::optional<std::uint16_t> read_port(ChildProcess& peer, Clock::time_point deadline) {
  std::optional<std::uint64_t> port;
  peer.read_until(
      [&](const std::string& out) {
        port = last_number(out, "PORT ");
        return port.has_value();
      },
      deadline);
  if (!port || *port > 0xFFFF) {
    ADD_FAILURE() << "the peer did not say its port\n" << peer.describe();
    return std::nullopt;
  }
  return static_cast<std::uint16_t>(*port);
}

std::optional<EndPointAddress> connect_peer(Side& side, std::unique_ptr<ChildProcess>& peer,
                                            PeerOptions options, const ConnectionParameters& params,
                                            const std::optional<EndPointAddress>& listen) {
  const auto deadline = Clock::now() + WAIT;
  const std::size_t before = side.observer.established_count_now();
  if (options.listen) {
    peer = std::make_unique<ChildProcess>(peer_command(options));
    const auto port = read_port(*peer, deadline);
    if (!port) return std::nullopt;
    const EndPointAddress remote{*options.listen, *port};
    side.backend->open_active_endpoint(remote, params);
    const bool decided = side.observer.wait(
        [&](const Observer& o) { return o.connection(remote) != nullptr || o.refused_count() > 0; },
        deadline);
    if (!decided || side.observer.connection_copy(remote) == std::nullopt) {
      ADD_FAILURE() << "no connection to the peer at " << remote << "\n" << peer->describe();
      return std::nullopt;
    }
    return remote;
  }
  options.connect = *listen;
  peer = std::make_unique<ChildProcess>(peer_command(options));
  const auto remote = await_peer_connection(side, *peer, before, deadline);
  if (!remote) {
    ADD_FAILURE() << "the peer did not connect to " << *listen << "\n" << peer->describe();
  }
  return remote;
}

std::optional<EndPointAddress> await_peer_connection(Side& side, ChildProcess& peer,
                                                     std::size_t before,
                                                     Clock::time_point deadline) {
  for (;;) {
    if (side.observer.established_count_now() > before) return side.observer.remote(before);
    if (Clock::now() >= deadline) return std::nullopt;
    // Its output, in slices (the connection is watched between them); an early return means
    // that the peer ended its output: it is exiting.
    const auto slice = std::min(deadline, Clock::now() + std::chrono::milliseconds{20});
    (void)peer.read_until([](const std::string&) { return false; }, slice);
    if (Clock::now() < slice) {
      (void)peer.wait(deadline);
      if (side.observer.established_count_now() > before) continue;
      return std::nullopt;
    }
  }
}

void report_measurement(const std::string& name, double value, const std::string& unit) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string test =
      info == nullptr ? "" : fmt::format("{}.{}", info->test_suite_name(), info->name());
  std::cout << fmt::format("MEASURED {} {} {:.1f} {}\n", test, name, value, unit) << std::flush;
  ::testing::Test::RecordProperty(name, fmt::format("{:.1f} {}", value, unit));
}

}  // namespace netio3::faults
