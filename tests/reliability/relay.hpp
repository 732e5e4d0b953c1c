#pragma once

// A TCP relay for the session tests: connections to its port on 127.0.0.1 are forwarded to a
// target port, byte for byte, by a thread of its own - until the test cuts them. Two cuts:
//  - reset(): every relayed connection is closed with a TCP reset on both sides (and, for
//    `refuse_for`, new ones are reset as they come: the peer's reconnects fail);
//  - freeze(): nothing moves any more, in either direction, and new connections wait in the
//    listen backlog - a link that went dark; thaw() lets everything move again (what the
//    kernels held flows on, as after a cable is plugged back in).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace netio3::test {

class Relay {
 public:
  explicit Relay(std::uint16_t target_port);
  ~Relay();
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;
  Relay(Relay&&) = delete;
  Relay& operator=(Relay&&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept { return m_port; }
  // New connections go to this port from now on.
  void retarget(std::uint16_t target_port) noexcept { m_target.store(target_port); }
  // Resets every relayed connection (both sides), and refuses new ones for `refuse_for`.
  // Returns once done.
  void reset(std::chrono::milliseconds refuse_for = std::chrono::milliseconds{0});
  // Returns once nothing moves any more.
  void freeze();
  void thaw();
  // Connections accepted so far.
  [[nodiscard]] int accepted() const noexcept { return m_accepted.load(); }

 private:
  struct Pair {
    int client;
    int server;
    std::vector<std::uint8_t> to_server;  // read from the client, not yet written
    std::vector<std::uint8_t> to_client;
    bool client_done{false};  // its end came; forwarded as a half-close once written
    bool server_done{false};
  };
  void run(const std::stop_token& stop);
  void accept_all();
  void close_pair(Pair& pair, bool with_reset);

  int m_listen{-1};
  std::uint16_t m_port{0};
  std::atomic<std::uint16_t> m_target;
  std::atomic<bool> m_frozen{false};
  std::atomic<int> m_accepted{0};
  std::mutex m_mutex;  // m_pairs, m_refuse_until, the reset handshake
  std::vector<Pair> m_pairs;
  std::chrono::steady_clock::time_point m_refuse_until{};
  std::jthread m_thread;
};

}  // namespace netio3::test
