// example_receiver: the "Receiver" of "Network communication > Example", as a complete
// program. Pair it with example_sender (the "Sender" of the same section).
//
// Deviations from the documented text:
//  - BackendType::LIBFABRIC is replaced by --backend (default "asyncmsg"); NetworkMode::RDMA
//    is kept (asyncmsg ignores the mode and uses TCP).
//  - std::format -> fmt::format (GCC 12 has no <format>).
//  - `ip` and `port` come from --ip (default 127.0.0.1) and --port (default 0: the OS picks
//    one). The program prints one extra line, "listening on IP:PORT", with the address
//    open_listen_endpoint returned, so that whoever starts the sender can find the port.
//  - `std::jthread([this]() { m_evloop->run(); })` -> `std::jthread([evloop]() {...})`:
//    the snippet is written as if inside a class; here the loop is a local variable.
//  - "// Wait for connection" and "// Receive data": main waits on a condition variable,
//    notified by the callbacks, until --messages messages arrived (0: no limit) or the
//    sender closed the connection, or until --timeout seconds passed (then it fails).
//  - on_data_cb prints the documented line plus the message number and text that
//    example_sender puts into each message (8-byte sequence number, then text), and checks
//    that they arrive in order. `capabilities` is [[maybe_unused]] (-Wunused-parameter);
//    `keys` is used: the receiver never sends, so it must be empty.
//  - The comment "capabilities will have true for receive, false for the rest" holds for
//    libfabric. asyncmsg needs no buffers, so it reports every capability as available.
//
// Run: example_receiver [--backend asyncmsg] [--ip 127.0.0.1] [--port 0] [--messages 10]
//                       [--timeout 30]
// Exit status 0 if --messages messages arrived intact and in order (or, with --messages 0,
// if the sender closed the connection).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;

int main(int argc, char** argv) {
  std::cout.setf(std::ios::unitbuf);  // line by line, also into a pipe
  const auto options = example::Options::parse(
      argc, argv, {{"ip", "127.0.0.1"}, {"port", "0"}, {"messages", "10"}, {"timeout", "30"}});
  if (!options) return 2;
  const auto backend_type = options->backend();
  const auto port = options->number<std::uint16_t>("port");
  const auto messages = options->number<std::uint64_t>("messages");
  const auto timeout = options->number<unsigned>("timeout");
  if (!backend_type || !port || !messages || !timeout) return 2;
  const std::string ip = options->str("ip");

  std::mutex mutex;
  std::condition_variable cv;
  std::uint64_t received = 0;
  bool connected = false;
  bool closed = false;
  std::string error;  // the first thing that went wrong

  try {
    auto evloop = std::make_shared<EpollEventLoop>();
    auto backend = Netio3Backend::create(
        *backend_type,
        {
            .mode = NetworkMode::RDMA,
            .thread_safety = ThreadSafetyModel::SAFE,
            .on_data_cb =
                [&](std::span<const std::uint8_t> data) {
                  std::cout << fmt::format("Received data of size {}\n", std::size(data));
                  const std::lock_guard lock{mutex};
                  std::uint64_t sequence = 0;
                  if (data.size() < sizeof(sequence)) {
                    if (error.empty()) error = "a message shorter than its sequence number";
                  } else {
                    std::memcpy(&sequence, data.data(), sizeof(sequence));
                    const auto text = data.subspan(sizeof(sequence));
                    std::cout << fmt::format(
                        "  message {}: \"{}\"\n", sequence,
                        std::string_view{reinterpret_cast<const char*>(text.data()),  // NOLINT
                                         text.size()});
                    if (sequence != received && error.empty()) {
                      error = fmt::format("message {} arrived when {} was expected", sequence,
                                          received);
                    }
                  }
                  ++received;
                  cv.notify_all();
                },
            .on_connection_established_cb =
                [&](const EndPointAddress& remote,
                    [[maybe_unused]] EndpointCapabilities capabilities) {
                  std::cout << fmt::format("Connection established with {}:{}\n", remote.address,
                                           remote.port);
                  // capabilities will have true for receive, false for the rest (libfabric)
                  const std::lock_guard lock{mutex};
                  connected = true;
                  cv.notify_all();
                },
            .on_connection_closed_cb =
                [&](const EndPointAddress& remote, const std::vector<std::uint64_t>& keys) {
                  std::cout << fmt::format("Connection closed with {}:{}\n", remote.address,
                                           remote.port);
                  const std::lock_guard lock{mutex};
                  if (!keys.empty() && error.empty()) {
                    error = fmt::format("{} cancelled send(s) reported, but nothing was sent",
                                        keys.size());
                  }
                  closed = true;
                  cv.notify_all();
                },
            .on_connection_refused_cb =
                [&](const EndPointAddress& remote) {
                  std::cout << fmt::format("Connection refused by {}:{}\n", remote.address,
                                           remote.port);
                },
        },
        evloop);
    auto thread = std::jthread([evloop]() { evloop->run(); });
    const example::StopLoopOnExit stop_loop{evloop};
    // Open a listen endpoint to accept connections and receive data on those
    const auto listen_endpoint =
        backend->open_listen_endpoint({ip, *port}, {.recv_params{.buf_size = 4096, .num_buf = 16}});
    std::cout << fmt::format("listening on {}\n", listen_endpoint);

    // Wait for connection
    // Receive data
    bool done = false;
    {
      std::unique_lock lock{mutex};
      done = cv.wait_for(lock, std::chrono::seconds{*timeout}, [&] {
        return closed || !error.empty() || (*messages > 0 && received >= *messages);
      });
    }
    backend->close_listen_endpoint(listen_endpoint);
    evloop->stop();
    thread.join();

    const std::lock_guard lock{mutex};
    if (!done) {
      std::cout << fmt::format("FAILED: timed out after {} s ({}, {} message(s) received)\n",
                               *timeout, connected ? "connected" : "never connected", received);
      return 1;
    }
    if (!error.empty()) {
      std::cout << fmt::format("FAILED: {}\n", error);
      return 1;
    }
    if (*messages > 0 && received != *messages) {
      std::cout << fmt::format("FAILED: {} message(s) received, {} expected\n", received,
                               *messages);
      return 1;
    }
    std::cout << fmt::format("OK: received {} message(s)\n", received);
  } catch (const std::exception& e) {
    std::cout << fmt::format("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
