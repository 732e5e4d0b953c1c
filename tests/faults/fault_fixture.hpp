#pragma once

// What the fault tests share: the test process's side of a connection, the command line of
// the peer program, and reading its output.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <netio3/netio3.hpp>

#include "fault_stream.hpp"
#include "test_support.hpp"

namespace netio3::faults {

using namespace std::chrono_literals;
using test::ChildProcess;

// Every wait of a passing test ends long before this; only a broken one waits it out.
inline constexpr auto WAIT = std::chrono::duration_cast<Clock::duration>(test::DEFAULT_TIMEOUT);

// Every backend compiled in, and its name for test names and the peer's command line.
[[nodiscard]] std::vector<BackendType> backends();
[[nodiscard]] std::string name_of(BackendType type);

// libfabric runs over its tcp provider here (NetworkMode::TCP selects it; FI_PROVIDER=tcp
// makes the choice explicit for this process and for every child, which inherit the
// environment, also through `ip netns exec`). Restores the previous value.
class ProviderEnvironment {
 public:
  explicit ProviderEnvironment(BackendType type);
  ~ProviderEnvironment();
  ProviderEnvironment(const ProviderEnvironment&) = delete;
  ProviderEnvironment& operator=(const ProviderEnvironment&) = delete;
  ProviderEnvironment(ProviderEnvironment&&) = delete;
  ProviderEnvironment& operator=(ProviderEnvironment&&) = delete;

 private:
  bool m_set{false};
  std::optional<std::string> m_saved;
};

// The test process's end: an observer, a loop on its own thread, a backend (destroyed
// first).
class Side {
 public:
  Side(BackendType type, std::size_t message_size,
       const std::function<void(NetworkConfig&)>& tweak = {},
       NetworkMode network = NetworkMode::TCP);
  ~Side();
  Side(const Side&) = delete;
  Side& operator=(const Side&) = delete;
  Side(Side&&) = delete;
  Side& operator=(Side&&) = delete;

  // Waits for the closed callback of `remote`; its time, or nullopt at the deadline.
  [[nodiscard]] std::optional<Clock::time_point> wait_closed(const EndPointAddress& remote,
                                                             Clock::time_point deadline);

  Observer observer;
  test::LoopThread loop;
  std::unique_ptr<NetworkBackend> backend;
};

struct PeerOptions {
  BackendType backend{BackendType::ASYNCMSG};
  bool send{false};
  std::optional<std::string> listen;       // IP to listen on (port 0)
  std::optional<EndPointAddress> connect;  // or the address to connect to
  std::uint64_t messages{0};               // 0: until the connection closes
  std::size_t size{4096};
  SendMode mode{SendMode::ZERO_COPY};
  NetworkMode network{NetworkMode::TCP};
  std::uint64_t stream{1};
  std::uint64_t progress{0};
  std::chrono::seconds timeout{60};
  std::vector<std::string> environment;  // NAME=value, added to the inherited environment
  std::optional<std::chrono::milliseconds> peer_timeout;  // limits.peer_timeout
  bool undumpable{false};           // the peer makes itself non-dumpable (no process may read it)
  std::vector<std::string> prefix;  // a command that runs the peer (e.g. setpriv ...)
  std::uint16_t port{0};            // --listen: the port (0: the OS chooses)
  // Sessions (delivery.session, set by the connecting side): on, with this back-off's longest
  // delay and give-up.
  bool session{false};
  std::chrono::milliseconds session_max_delay{500};
  std::chrono::milliseconds give_up{60000};
  std::uint64_t rate{0};  // a sender's messages per second (0: unpaced)
};

// argv of netio3_fault_peer, optionally run inside a network namespace (`ip netns exec`,
// which keeps the environment).
[[nodiscard]] std::vector<std::string> peer_command(const PeerOptions& options,
                                                    const std::string& netns = {});

// Reading the peer's output (see fault_peer.cpp for its lines).
// The number after the last line that starts with `prefix` (e.g. "RECEIVED "), if the line
// is complete.
[[nodiscard]] std::optional<std::uint64_t> last_number(const std::string& text,
                                                       std::string_view prefix);
// The complete line that starts with `prefix`, if there is one.
[[nodiscard]] std::optional<std::string> line_starting(const std::string& text,
                                                       std::string_view prefix);
// The value of `key=` in a line.
[[nodiscard]] std::optional<std::int64_t> field(std::string_view line, std::string_view key);

// Reads both peers' output until each printed its "END " line, or `deadline`; whether both did.
[[nodiscard]] bool read_until_both_ended(ChildProcess& receiver, ChildProcess& sender,
                                         Clock::time_point deadline);

// The port a listening peer printed ("PORT <port>"), read until `deadline`; nullopt (after an
// ADD_FAILURE with the peer's output) when it said none.
[[nodiscard]] std::optional<std::uint16_t> read_port(ChildProcess& peer,
                                                     Clock::time_point deadline);

// Starts a peer and makes the connection with `side`: the peer listens and `side` connects
// (options.listen set), or `side` listens at `listen` and the peer connects. Returns how
// `side` addresses the connection (nullopt after an ADD_FAILURE explaining why).
[[nodiscard]] std::optional<EndPointAddress> connect_peer(
    Side& side, std::unique_ptr<ChildProcess>& peer, PeerOptions options,
    const ConnectionParameters& params, const std::optional<EndPointAddress>& listen);

// Waits until `side` has a connection more than the `before` it had, reading the peer's
// output meanwhile (so that describe() shows what a peer that failed to start said), and
// returns how `side` addresses it; nullopt at the deadline or once the peer has exited
// without connecting.
[[nodiscard]] std::optional<EndPointAddress> await_peer_connection(Side& side, ChildProcess& peer,
                                                                   std::size_t before,
                                                                   Clock::time_point deadline);

// Runs a command to its end; "" on success, else what went wrong.
[[nodiscard]] std::string run_command(const std::vector<std::string>& argv);

// Two network namespaces joined by a veth pair with 10.x.y.1/24 (A) and 10.x.y.2/24 (B),
// named after this process (x.y from its pid). Deleted on destruction, also when a test
// fails (the veth goes with them).
class NamespacePair {
 public:
  NamespacePair();
  ~NamespacePair();
  NamespacePair(const NamespacePair&) = delete;
  NamespacePair& operator=(const NamespacePair&) = delete;
  NamespacePair(NamespacePair&&) = delete;
  NamespacePair& operator=(NamespacePair&&) = delete;

  // Why the namespaces could not be set up; empty when they were.
  [[nodiscard]] const std::string& why() const { return m_why; }

  // A loses its link (and B its carrier); "" or what went wrong.
  [[nodiscard]] std::string cut() const;
  // A's link is back (and running); "" or what went wrong.
  [[nodiscard]] std::string restore() const;

  std::string ns_a, ns_b, veth_a, veth_b, ip_a, ip_b;

 private:
  std::string m_why;
  bool m_created_a{false};
  bool m_created_b{false};
};

// Prints a measurement as one machine-readable line and records it as a test property.
void report_measurement(const std::string& name, double value, const std::string& unit);

}  // namespace netio3::faults
