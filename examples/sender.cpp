// example_sender: the "Sender" of "Network communication > Example", as a complete
// program. Pair it with example_receiver (the "Receiver" of the same section).
//
// Deviations from the documented text:
//  - BackendType::LIBFABRIC is replaced by --backend (default "asyncmsg"); NetworkMode::RDMA
//    is kept (asyncmsg ignores the mode and uses TCP).
//  - std::format -> fmt::format (GCC 12 has no <format>).
//  - `ip` and `port` come from --ip (default 127.0.0.1) and --port (required: the port the
//    receiver printed in its "listening on" line).
//  - `std::jthread([this]() { m_evloop->run(); })` -> `std::jthread([evloop]() {...})`:
//    the snippet is written as if inside a class; here the loop is a local variable.
//  - The callbacks also record what happened and notify a condition variable, so that main
//    can wait with deadlines: "// Wait for connection" waits for
//    on_connection_established_cb (or on_connection_refused_cb: then the program fails).
//    `capabilities` is [[maybe_unused]] (-Wunused-parameter); `keys` is used: cancelled
//    sends are a failure.
//  - The single get_buffer/write/send_buffer block is repeated for --messages messages.
//    `data` (undefined in the snippet) is message i: its 8-byte sequence number followed
//    by the text "message i" (written with the span overload of NetworkBuffer::write).
//    "// Handle status" is filled in as the comment suggests: NO_RESOURCES -> wait until
//    on_ready_to_send_cb says the connection takes sends again, then try again (the buffer
//    is still ours); FAILED -> give up. When get_buffer returns nullptr all buffers are in
//    flight: the same wait, then try again. on_ready_to_send_cb is not in the documented
//    snippet; it is the optional callback appended to NetworkConfig for exactly this
//    (docs/guide.md). Every wait has a deadline (--timeout); nothing spins.
//  - Before close_active_endpoint, the program waits until on_send_completed_cb reported
//    every send, and after it until on_connection_closed_cb came.
//
// Run: example_sender --port PORT [--backend asyncmsg] [--ip 127.0.0.1] [--messages 10]
//                     [--timeout 30]
// Exit status 0 if the connection was established and every message was sent and
// completed.

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
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  std::cout.setf(std::ios::unitbuf);  // line by line, also into a pipe
  const auto options = example::Options::parse(
      argc, argv, {{"ip", "127.0.0.1"}, {"port", ""}, {"messages", "10"}, {"timeout", "30"}});
  if (!options) return 2;
  const auto backend_type = options->backend();
  const auto port = options->number<std::uint16_t>("port");
  const auto messages = options->number<std::uint64_t>("messages");
  const auto timeout_s = options->number<unsigned>("timeout");
  if (!backend_type || !port || !messages || !timeout_s) return 2;
  if (*port == 0) {
    std::cerr << "--port: the receiver's port is required\n";
    return 2;
  }
  const std::string ip = options->str("ip");
  const auto deadline = Clock::now() + std::chrono::seconds{*timeout_s};

  std::mutex mutex;
  std::condition_variable cv;
  bool established = false;
  bool refused = false;
  bool closed = false;
  std::uint64_t completed = 0;
  std::uint64_t ready = 0;  // on_ready_to_send_cb calls
  std::vector<std::uint64_t> cancelled;
  const auto wait_until = [&](auto condition) {
    std::unique_lock lock{mutex};
    return cv.wait_until(lock, deadline, condition);
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
                  // capabilities will have true for buffered sending, false for the rest
                  // (libfabric; asyncmsg reports every capability as available)
                  const std::lock_guard lock{mutex};
                  established = true;
                  cv.notify_all();
                },
            .on_connection_closed_cb =
                [&](const EndPointAddress& remote, const std::vector<std::uint64_t>& keys) {
                  std::cout << fmt::format("Connection closed with {}:{}\n", remote.address,
                                           remote.port);
                  const std::lock_guard lock{mutex};
                  cancelled.insert(cancelled.end(), keys.begin(), keys.end());
                  closed = true;
                  cv.notify_all();
                },
            .on_connection_refused_cb =
                [&](const EndPointAddress& remote) {
                  std::cout << fmt::format("Connection refused by {}:{}\n", remote.address,
                                           remote.port);
                  const std::lock_guard lock{mutex};
                  refused = true;
                  cv.notify_all();
                },
            .on_send_completed_cb =
                [&](const EndPointAddress& remote, std::uint64_t key) {
                  std::cout << fmt::format("Send operation to {}:{} with key {} completed\n",
                                           remote.address, remote.port, key);
                  const std::lock_guard lock{mutex};
                  ++completed;
                  cv.notify_all();
                },
            .on_ready_to_send_cb =
                [&](const EndPointAddress&) {
                  const std::lock_guard lock{mutex};
                  ++ready;
                  cv.notify_all();
                },
        },
        evloop);
    auto thread = std::jthread([evloop]() { evloop->run(); });
    const example::StopLoopOnExit stop_loop{evloop};
    const auto endpoint = EndPointAddress{ip, *port};
    // Open a send endpoint to send data to the receiver (buffered sending)
    backend->open_active_endpoint(endpoint,
                                  {.send_buffered_params{.buf_size = 4096, .num_buf = 16}});
    // Wait for connection
    if (!wait_until([&] { return established || refused || closed; }) || !established) {
      std::cout << fmt::format("FAILED: no connection with {} ({})\n", endpoint,
                               refused ? "refused" : "timed out");
      return 1;
    }

    // Waits until on_ready_to_send_cb came after the `seen` calls before (or the connection
    // closed): after NO_RESOURCES or an empty pool, the backend says when to try again.
    // False when the connection closed or the deadline passed.
    const auto wait_until_ready = [&](std::uint64_t seen) {
      return wait_until([&] { return ready > seen || closed; }) && !closed;
    };

    std::uint64_t sent = 0;
    for (std::uint64_t i = 0; i < *messages; ++i) {
      std::vector<std::uint8_t> data(sizeof(i));
      std::memcpy(data.data(), &i, sizeof(i));
      const auto text = fmt::format("message {}", i);
      data.insert(data.end(), text.begin(), text.end());

      bool done = false;
      while (!done) {
        std::uint64_t seen = 0;  // read before the call: no callback after it is missed
        {
          const std::lock_guard lock{mutex};
          seen = ready;
        }
        auto* buf = backend->get_buffer(endpoint);
        if (buf == nullptr) {  // all buffers in flight: wait until one comes back
          if (!wait_until_ready(seen)) {
            std::cout << fmt::format("FAILED: no send buffer became free for message {}\n", i);
            return 1;
          }
          continue;
        }
        buf->write(data);
        while (!done) {
          const auto status = backend->send_buffer(endpoint, buf);
          switch (status) {
            case NetioStatus::OK:
              ++sent;
              done = true;
              break;
            case NetioStatus::NO_RESOURCES:  // try again when ready (we still own buf)
              if (!wait_until_ready(seen)) {
                std::cout << fmt::format("FAILED: message {} still not accepted\n", i);
                return 1;
              }
              {
                const std::lock_guard lock{mutex};
                seen = ready;
              }
              break;
            case NetioStatus::FAILED:
              std::cout << fmt::format("FAILED: send_buffer of message {} returned FAILED\n", i);
              return 1;
          }
        }
      }
    }

    // Every send that returned OK ends in on_send_completed_cb (or, if the connection
    // closes first, in the keys of on_connection_closed_cb).
    if (!wait_until([&] { return completed + cancelled.size() >= sent; })) {
      std::cout << fmt::format("FAILED: {} of {} sends completed within the deadline\n", completed,
                               sent);
      return 1;
    }
    try {
      backend->close_active_endpoint(endpoint);
    } catch (const UnknownActiveEndpoint&) {
      // The receiver closed first (it stops after the last message): nothing to close.
    }
    if (!wait_until([&] { return closed; })) {
      std::cout << "FAILED: no on_connection_closed_cb after close_active_endpoint\n";
      return 1;
    }
    evloop->stop();
    thread.join();

    const std::lock_guard lock{mutex};
    if (completed != sent || !cancelled.empty()) {
      std::cout << fmt::format("FAILED: {} sent, {} completed, {} cancelled\n", sent, completed,
                               cancelled.size());
      return 1;
    }
    std::cout << fmt::format("OK: sent {} message(s) to {}, all completed\n", sent, endpoint);
  } catch (const std::exception& e) {
    std::cout << fmt::format("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
