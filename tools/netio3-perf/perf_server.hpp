#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <netio3/netio3.hpp>

#include "protocol.hpp"

namespace netio3::perf {

struct ServerOptions {
  BackendType backend{BackendType::ASYNCMSG};
  NetworkMode mode{NetworkMode::TCP};
  std::string bind{"127.0.0.1"};
  std::uint16_t port{0};
  std::size_t max_size{(std::size_t{1} << 20U) + 64};  // largest message accepted
  std::size_t recv_buffers{64};                        // per connection
  bool quiet{false};
  std::string partition_key;  // NetworkConfig::partition_key; empty: none
};

// The receiving end: accepts connections, checks every DATA message (order, size, content),
// echoes PINGs and answers END with a REPORT. Runs entirely on its loop's thread (the
// backend is UNSAFE). Construct it before the loop runs or on the loop thread; destroy it
// on any thread.
class PerfServer {
 public:
  PerfServer(const ServerOptions& options, std::shared_ptr<BaseEventLoop> loop);
  ~PerfServer();
  PerfServer(const PerfServer&) = delete;
  PerfServer& operator=(const PerfServer&) = delete;
  PerfServer(PerfServer&&) = delete;
  PerfServer& operator=(PerfServer&&) = delete;

  [[nodiscard]] const EndPointAddress& address() const { return m_address; }

 private:
  struct Session {
    EndPointAddress remote;
    bool started{false};
    StartBody start{};
    std::unique_ptr<Pattern> pattern;
    std::uint64_t expected_seq{0};
    std::uint64_t received{0};
    std::uint64_t bytes{0};
    std::uint64_t errors{0};
    std::uint64_t cpu_at_start{0};
    std::uint64_t time_at_start{0};
    std::vector<EndPointAddress> extra_listeners;   // opened for this client's OPEN
    std::vector<std::vector<std::uint8_t>> unsent;  // replies waiting for a free buffer
  };

  void on_established(const EndPointAddress& remote);
  void on_closed(const EndPointAddress& remote);
  void on_completed(const EndPointAddress& remote);
  void on_data(std::span<const std::uint8_t> data);
  void on_start(Session& s, std::span<const std::uint8_t> data);
  void on_open(Session& s, const Header& h);
  void reply(Session& s, std::span<const std::uint8_t> message);
  bool try_send(const EndPointAddress& to, std::span<const std::uint8_t> message);
  Session* find(std::uint32_t token);
  [[nodiscard]] ConnectionParameters listen_params() const;
  void complain(const std::string& what);

  ServerOptions m_options;
  std::shared_ptr<BaseEventLoop> m_loop;
  std::unique_ptr<NetworkBackend> m_backend;
  EndPointAddress m_address;
  std::uint32_t m_next_token{1};
  std::unordered_map<std::uint32_t, Session> m_sessions;
  std::unordered_map<EndPointAddress, std::uint32_t> m_token_of;
  std::uint32_t m_cached_token{0};
  Session* m_cached{nullptr};
  std::uint64_t m_complaints{0};
};

// Process CPU time (user + system) in nanoseconds, and a monotonic clock in nanoseconds.
[[nodiscard]] std::uint64_t process_cpu_ns();
[[nodiscard]] std::uint64_t now_ns();

}  // namespace netio3::perf
