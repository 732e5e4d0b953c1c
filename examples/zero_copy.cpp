// example_zero_copy: the snippet of "Network communication > Sending data > Zero-copy
// sending", as a complete program. The backend listens on port 0 and sends to itself, so
// the program can show what arrives: the header_data travels in front of the payload and
// on_data_cb sees header + payload as one contiguous span ({0x0} + {0x1, 0x2} ->
// "00 01 02").
//
// Deviations from the documented text:
//  - The backend type comes from --backend (default "asyncmsg"); the mode is
//    NetworkMode::RDMA, as in the other examples (asyncmsg ignores it and uses TCP).
//  - `ip` comes from --ip (default 127.0.0.1); `listen_port` is the port the OS chose for
//    the program's own listen endpoint (opened on port 0); `send_endpoint` (undefined in
//    the snippet) is the address the active endpoint was opened with, {ip, listen_port}.
//  - Added around the snippet: the backend with callbacks that print and record what
//    arrives, the event-loop thread, and a wait (condition variable with a deadline) for
//    the connection between open_active_endpoint and send_data: sending needs an
//    established connection.
//  - "// handle status": anything but NetioStatus::OK is a failure here (the connection is
//    established and nothing else is queued).
//  - Added after the snippet: the program waits for on_send_completed_cb with the key, then
//    for the data, checks both, and only then lets `data` go out of scope.
//
// Run: example_zero_copy [--backend asyncmsg] [--ip 127.0.0.1]
// Exit status 0 if exactly one message {0x0, 0x1, 0x2} arrived and key 0 completed.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;
using namespace std::chrono_literals;

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
  std::vector<std::vector<std::uint8_t>> received;
  std::vector<std::uint64_t> completed_keys;
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
            .on_data_cb =
                [&](std::span<const std::uint8_t> data) {
                  // The span is valid only during this call: print and copy it now.
                  std::cout << fmt::format("Received {} bytes in one span: {:02x}\n", data.size(),
                                           fmt::join(data, " "));
                  const std::lock_guard lock{mutex};
                  received.emplace_back(data.begin(), data.end());
                  cv.notify_all();
                },
            .on_connection_established_cb =
                [&](const EndPointAddress& remote,
                    [[maybe_unused]] EndpointCapabilities capabilities) {
                  std::cout << fmt::format("Connection established with {}\n", remote);
                  const std::lock_guard lock{mutex};
                  ++established;
                  cv.notify_all();
                },
            .on_send_completed_cb =
                [&](const EndPointAddress& remote, std::uint64_t key) {
                  std::cout << fmt::format("Send operation to {} with key {} completed\n", remote,
                                           key);
                  const std::lock_guard lock{mutex};
                  completed_keys.push_back(key);
                  cv.notify_all();
                },
        },
        evloop);
    auto thread = std::jthread([evloop]() { evloop->run(); });
    const example::StopLoopOnExit stop_loop{evloop};

    const auto listen_endpoint =
        backend->open_listen_endpoint({ip, 0}, {.recv_params{.buf_size = 4096, .num_buf = 16}});
    const auto listen_port = listen_endpoint.port;
    const auto send_endpoint = EndPointAddress{ip, listen_port};

    // ---- documented snippet (with the wait for the connection added) ---------------
    std::vector<std::uint8_t> data = {0x1, 0x2};
    const std::vector<std::uint8_t> header_data = {0x0};
    const auto key = std::uint64_t{0};
    backend->open_active_endpoint(
        {ip, listen_port},
        {.send_zero_copy_params{.buf_size = data.size(), .mr_start = data.data()}});
    if (!wait_until([&] { return established == 2; })) {  // added: wait for connection
      std::cout << "FAILED: the connection was not established within 10 s\n";
      return 1;
    }
    const auto status = backend->send_data(send_endpoint, data, header_data, key);
    // handle status
    if (status != NetioStatus::OK) {
      std::cout << fmt::format("FAILED: send_data returned {}\n", status);
      return 1;
    }
    // header_data can be discarded here
    // data must not be modified until on_send_completed_cb with matching key is called
    // ---- end of the documented snippet ---------------------------------------------

    std::cout << fmt::format("send_data({}, payload {:02x}, header {:02x}, key {}) returned {}\n",
                             send_endpoint, fmt::join(data, " "), fmt::join(header_data, " "), key,
                             status);
    const bool completed = wait_until([&] { return !completed_keys.empty(); });
    const bool arrived = wait_until([&] { return !received.empty(); });
    backend->close_active_endpoint(send_endpoint);
    backend->close_listen_endpoint(listen_endpoint);
    evloop->stop();
    thread.join();

    const std::vector<std::uint8_t> expected = {0x0, 0x1, 0x2};  // header + payload
    const std::lock_guard lock{mutex};
    if (!completed || completed_keys != std::vector<std::uint64_t>{key}) {
      std::cout << fmt::format("FAILED: expected one completion with key {}, got [{}]\n", key,
                               fmt::join(completed_keys, ", "));
      return 1;
    }
    if (!arrived || received.size() != 1 || received.front() != expected) {
      std::cout << fmt::format("FAILED: expected one message {:02x}, got {} message(s)\n",
                               fmt::join(expected, " "), received.size());
      return 1;
    }
    std::cout << "OK: header and payload arrived as one message\n";
  } catch (const std::exception& e) {
    std::cout << fmt::format("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
