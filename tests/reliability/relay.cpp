#include "relay.hpp"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdexcept>
#include <string>
#include <sys/socket.h>
#include <unistd.h>

namespace netio3::test {
namespace {

constexpr std::size_t CHUNK = 256 * 1024;

void non_blocking(int fd) {
  (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

sockaddr_in loopback(std::uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

void close_with_reset(int fd) {
  const linger l{1, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  ::close(fd);
}

// Moves what `from` has into `pending`, then as much of `pending` as `to` takes; `from`'s end
// is passed on (a half-close) once what came before it is written. False when a side failed.
bool pump(int from, int to, std::vector<std::uint8_t>& pending, bool& ended, bool readable,
          bool writable) {
  if (readable && !ended && pending.size() < CHUNK) {
    const std::size_t have = pending.size();
    pending.resize(CHUNK);
    const ssize_t n = ::recv(from, pending.data() + have, CHUNK - have, MSG_DONTWAIT);
    pending.resize(have + (n > 0 ? static_cast<std::size_t>(n) : 0));
    if (n < 0 && errno != EAGAIN && errno != EINTR) return false;
    if (n == 0) ended = true;
  }
  if ((writable || readable) && !pending.empty()) {
    const ssize_t n = ::send(to, pending.data(), pending.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) return false;
    if (n > 0) pending.erase(pending.begin(), pending.begin() + n);
  }
  if (ended && pending.empty()) (void)::shutdown(to, SHUT_WR);
  return true;
}

}  // namespace

Relay::Relay(std::uint16_t target_port) : m_target{target_port} {
  m_listen = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  (void)::setsockopt(m_listen, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a = loopback(0);
  if (::bind(m_listen, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||  // NOLINT
      ::listen(m_listen, 64) != 0) {
    throw std::runtime_error("relay: cannot listen: " + std::string{strerror(errno)});
  }
  socklen_t len = sizeof a;
  (void)::getsockname(m_listen, reinterpret_cast<sockaddr*>(&a), &len);  // NOLINT
  m_port = ntohs(a.sin_port);
  non_blocking(m_listen);
  m_thread = std::jthread{[this](const std::stop_token& stop) { run(stop); }};
}

Relay::~Relay() {
  m_thread.request_stop();
  m_thread.join();
  for (auto& pair : m_pairs) close_pair(pair, true);
  ::close(m_listen);
}

void Relay::close_pair(Pair& pair, bool with_reset) {
  for (const int fd : {pair.client, pair.server}) {
    if (fd < 0) continue;
    if (with_reset) {
      close_with_reset(fd);
    } else {
      ::close(fd);
    }
  }
  pair.client = pair.server = -1;
}

void Relay::reset(std::chrono::milliseconds refuse_for) {
  const std::lock_guard lock{m_mutex};
  for (auto& pair : m_pairs) close_pair(pair, true);
  m_pairs.clear();
  m_refuse_until = std::chrono::steady_clock::now() + refuse_for;
}

void Relay::freeze() {
  // Under the lock the relay pumps with: once this returns, nothing moves.
  const std::lock_guard lock{m_mutex};
  m_frozen.store(true);
}

void Relay::thaw() {
  m_frozen.store(false);
}

void Relay::accept_all() {
  for (;;) {
    const int client = ::accept4(m_listen, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (client < 0) return;
    ++m_accepted;
    if (std::chrono::steady_clock::now() < m_refuse_until) {
      close_with_reset(client);
      continue;
    }
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_in a = loopback(m_target.load());
    if (::connect(server, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {  // NOLINT
      close_with_reset(client);
      ::close(server);
      continue;
    }
    non_blocking(server);
    const int one = 1;
    (void)::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    (void)::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    m_pairs.push_back(Pair{client, server, {}, {}});
  }
}

void Relay::run(const std::stop_token& stop) {
  std::vector<pollfd> fds;
  while (!stop.stop_requested()) {
    if (m_frozen.load()) {
      // Dark: nothing is read, written or accepted. Checked again every few milliseconds.
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
      continue;
    }
    {
      const std::lock_guard lock{m_mutex};
      fds.clear();
      fds.push_back(pollfd{m_listen, POLLIN, 0});
      for (const auto& pair : m_pairs) {
        fds.push_back(pollfd{
            pair.client,
            static_cast<short>((pair.to_server.size() < CHUNK && !pair.client_done ? POLLIN : 0) |
                               (pair.to_client.empty() ? 0 : POLLOUT)),
            0});
        fds.push_back(pollfd{
            pair.server,
            static_cast<short>((pair.to_client.size() < CHUNK && !pair.server_done ? POLLIN : 0) |
                               (pair.to_server.empty() ? 0 : POLLOUT)),
            0});
      }
    }
    // A bounded wait, so that freeze(), reset() and a stop are seen promptly.
    if (::poll(fds.data(), fds.size(), 5) <= 0) continue;
    const std::lock_guard lock{m_mutex};
    if (m_frozen.load()) continue;
    if ((fds[0].revents & POLLIN) != 0) accept_all();
    // reset() may have emptied the list since the poll: match by descriptor.
    for (std::size_t i = 1; i + 1 < fds.size(); i += 2) {
      for (auto& pair : m_pairs) {
        if (pair.client != fds[i].fd || pair.server != fds[i + 1].fd) continue;
        const auto in = [](short r) { return (r & (POLLIN | POLLHUP | POLLERR)) != 0; };
        const auto out = [](short r) { return (r & POLLOUT) != 0; };
        const bool ok = pump(pair.client, pair.server, pair.to_server, pair.client_done,
                             in(fds[i].revents), out(fds[i + 1].revents)) &&
                        pump(pair.server, pair.client, pair.to_client, pair.server_done,
                             in(fds[i + 1].revents), out(fds[i].revents));
        if (!ok) {
          close_pair(pair, true);
        } else if (pair.client_done && pair.server_done && pair.to_client.empty() &&
                   pair.to_server.empty()) {
          close_pair(pair, false);
        }
        break;
      }
    }
    std::erase_if(m_pairs, [](const Pair& p) { return p.client < 0; });
  }
}

}  // namespace netio3::test
