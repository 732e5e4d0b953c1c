// example_connect: the example of "Network communication > Opening a connection >
// Callbacks", as a complete program. One backend listens on port 0 and connects to its own
// listen endpoint: on_connection_established_cb runs twice, once for each side of the
// connection (both sides live in this backend). Then it connects to a port nobody listens
// on: on_connection_refused_cb runs once.
//
// Deviations from the documented text:
//  - BackendType::LIBFABRIC is replaced by --backend (default "asyncmsg"); NetworkMode::RDMA
//    is kept (asyncmsg ignores the mode and uses TCP).
//  - std::format -> fmt::format (GCC 12 has no <format>).
//  - `ip` comes from --ip (default 127.0.0.1).
//  - `std::jthread([this]() { m_evloop->run(); })` -> `std::jthread([evloop]() {...})`:
//    the snippet is written as if inside a class; here the loop is a local variable.
//  - The callbacks capture a mutex, a condition variable and counters by reference, and
//    notify after printing, so that main can wait for them ("Will invoke ..." in the text)
//    with a deadline. `capabilities` is [[maybe_unused]] (-Wunused-parameter).
//  - `{recv_params{.buf_size = 4096, .num_buf = 16}}` is a typo for
//    `{.recv_params{.buf_size = 4096, .num_buf = 16}}` (designators cannot be mixed).
//  - `wrong_listen_port = 1234` ("unless we got really really lucky") is replaced by a port
//    that was free a moment ago: a socket is bound to port 0, its port read back, and the
//    socket closed again, so nobody listens on that port.
//  - Added at the end: the checks, closing both endpoints, and evloop->stop().
//
// Run: example_connect [--backend asyncmsg] [--ip 127.0.0.1]
// Exit status 0 if exactly two "established" and one "refused" callback came.

#include <arpa/inet.h>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <netinet/in.h>
#include <optional>
#include <stdexcept>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;
using namespace std::chrono_literals;

namespace {

// A TCP port on `ip` that nobody listens on: bind to port 0, read the port back, close.
std::uint16_t unused_port(const std::string& ip) {
  sockaddr_storage storage{};
  socklen_t length = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);   // NOLINT
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);  // NOLINT
  if (::inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    length = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    length = sizeof(sockaddr_in6);
  } else {
    throw std::runtime_error(fmt::format("'{}' is not a numeric IP address", ip));
  }
  const int fd = ::socket(storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(fmt::format("socket: {}", std::strerror(errno)));
  auto* sa = reinterpret_cast<sockaddr*>(&storage);  // NOLINT
  if (::bind(fd, sa, length) != 0 || ::getsockname(fd, sa, &length) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error(fmt::format("bind/getsockname: {}", std::strerror(err)));
  }
  ::close(fd);
  return ntohs(storage.ss_family == AF_INET ? v4->sin_port : v6->sin6_port);
}

}  // namespace

int main(int argc, char** argv) {
  std::cout.setf(std::ios::unitbuf);  // line by line, also into a pipe
  const auto options = example::Options::parse(argc, argv, {{"ip", "127.0.0.1"}});
  if (!options) return 2;
  const auto backend_type = options->backend();
  if (!backend_type) return 2;
  const std::string ip = options->str("ip");

  std::mutex mutex;
  std::condition_variable cv;
  int established = 0;
  std::vector<EndPointAddress> refused;
  const auto wait_until = [&](auto condition) {
    std::unique_lock lock{mutex};
    return cv.wait_for(lock, 10s, condition);
  };

  try {
    auto evloop = std::make_shared<EpollEventLoop>();
    auto backend = Netio3Backend::create(
        *backend_type,
        {
            .mode = NetworkMode::RDMA,
            .thread_safety = ThreadSafetyModel::SAFE,
            .on_connection_established_cb =
                [&](const EndPointAddress& remote,
                    [[maybe_unused]] EndpointCapabilities capabilities) {
                  std::cout << fmt::format("Connection established with {}:{}\n", remote.address,
                                           remote.port);
                  {
                    const std::lock_guard lock{mutex};
                    ++established;
                  }
                  cv.notify_all();
                },
            .on_connection_refused_cb =
                [&](const EndPointAddress& remote) {
                  std::cout << fmt::format("Connection refused by {}:{}\n", remote.address,
                                           remote.port);
                  {
                    const std::lock_guard lock{mutex};
                    refused.push_back(remote);
                  }
                  cv.notify_all();
                },
        },
        evloop);

    auto thread = std::jthread([evloop]() { evloop->run(); });
    const example::StopLoopOnExit stop_loop{evloop};

    const auto listen_endpoint =
        backend->open_listen_endpoint({ip, 0}, {.recv_params{.buf_size = 4096, .num_buf = 16}});
    backend->open_active_endpoint(listen_endpoint,
                                  {.send_buffered_params{.buf_size = 4096, .num_buf = 16}});
    // Will invoke on_connection_established_cb
    if (!wait_until([&] { return established >= 2; })) {
      std::cout << fmt::format(
          "FAILED: expected on_connection_established_cb for both sides of the connection to {} "
          "within 10 s, got {}\n",
          listen_endpoint, established);
      return 1;
    }

    const auto wrong_listen_port = unused_port(ip);
    backend->open_active_endpoint({ip, wrong_listen_port},
                                  {.send_buffered_params{.buf_size = 4096, .num_buf = 16}});
    // Will invoke on_connection_refused_cb because no listen endpoint is open on that port
    if (!wait_until([&] { return !refused.empty(); })) {
      std::cout << fmt::format(
          "FAILED: no on_connection_refused_cb within 10 s for {}:{} (nobody listens there)\n", ip,
          wrong_listen_port);
      return 1;
    }

    backend->close_active_endpoint(listen_endpoint);
    backend->close_listen_endpoint(listen_endpoint);
    evloop->stop();
    thread.join();

    const std::lock_guard lock{mutex};
    const EndPointAddress wrong{ip, wrong_listen_port};
    if (established != 2 || refused.size() != 1 || refused.front() != wrong) {
      std::cout << fmt::format(
          "FAILED: expected 2 established and 1 refused (by {}), got {} established and {} "
          "refused\n",
          wrong, established, refused.size());
      return 1;
    }
    std::cout << fmt::format("OK: {} x established, {} x refused\n", established, refused.size());
  } catch (const std::exception& e) {
    std::cout << fmt::format("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
