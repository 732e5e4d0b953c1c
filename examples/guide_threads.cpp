// example_guide_threads: the user guide's program for buffered and copy sends from a thread
// of the application (docs/guide.md, "Sending from your own thread"). The event loop runs on
// a thread of its own; the main thread sends to example_guide_receiver and, when the backend
// says "not now", waits on a condition variable that on_ready_to_send_cb notifies.
//
//   --send buffered   get_buffer / write / send_buffer (the key is the buffer's id)
//   --send copy       send_data_copy: the data is copied before the call returns. libfabric
//                     cannot copy (capabilities.send_copy is false): the program says so
//                     and sends buffered instead.
//
// Run: example_guide_threads --port PORT [--backend asyncmsg] [--mode tcp] [--ip 127.0.0.1]
//                            [--send buffered] [--messages 10000] [--size 4096]
// Exit status 0 if every send completed; 1 otherwise.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;
using namespace std::chrono_literals;

int main(int argc, char** argv) {
  const auto options = example::Options::parse(argc, argv,
                                               {{"mode", "tcp"},
                                                {"ip", "127.0.0.1"},
                                                {"port", "0"},
                                                {"send", "buffered"},
                                                {"messages", "10000"},
                                                {"size", "4096"}});
  if (!options) return 2;
  const auto type = options->backend();
  const auto mode = parse_network_mode(options->str("mode"));
  const auto port = options->number<std::uint16_t>("port");
  const auto messages = options->number<std::uint64_t>("messages");
  const auto size = options->number<std::size_t>("size");
  bool copy = options->str("send") == "copy";
  if (!type || !mode || !port || !messages || !size) return 2;
  if (*port == 0 || (!copy && options->str("send") != "buffered")) {
    std::fprintf(stderr, "--port is required; --send is buffered or copy\n");
    return 2;
  }
  const EndPointAddress server{options->str("ip"), *port};

  try {
    // [shared_state]
    // What the callbacks (loop thread) tell the sending thread, under one mutex.
    struct State {
      std::mutex mutex;
      std::condition_variable cv;
      bool connected = false;
      bool closed = false;
      bool can_copy = false;
      std::uint64_t ready = 0;  // on_ready_to_send_cb calls so far
      std::uint64_t completed = 0;
      std::uint64_t cancelled = 0;
    } state;
    const auto update = [&state](auto change) {
      {
        const std::lock_guard lock{state.mutex};
        change();
      }
      state.cv.notify_all();
    };
    // [shared_state]

    // [create]
    auto loop = std::make_shared<EpollEventLoop>();
    auto backend = Netio3Backend::create(
        *type,
        {.mode = *mode,
         .thread_safety = ThreadSafetyModel::SAFE,  // every call from any thread
         .on_connection_established_cb =
             [&](const EndPointAddress&, EndpointCapabilities capabilities) {
               update([&] {
                 state.connected = true;
                 state.can_copy = capabilities.send_copy;
               });
             },
         .on_connection_closed_cb =
             [&](const EndPointAddress&, const std::vector<std::uint64_t>& keys) {
               update([&] {
                 state.closed = true;
                 state.cancelled += keys.size();
               });
             },
         .on_send_completed_cb = [&](const EndPointAddress&,
                                     std::uint64_t) { update([&] { ++state.completed; }); },
         .on_ready_to_send_cb = [&](const EndPointAddress&) { update([&] { ++state.ready; }); },
         .on_connection_refused_reason_cb =
             [&](const EndPointAddress& remote, const RefusalReason& reason) {
               fmt::print("connection to {} refused: {}\n", remote, reason.message);
               update([&] { state.closed = true; });
             }},
        loop);
    std::jthread loop_thread{[loop] { loop->run(); }};
    const example::StopLoopOnExit stop_loop{loop};  // also on an early return
    // [create]

    // [wait]
    // Waits until `condition` holds (under the mutex); false after 10 s or a closed connection.
    const auto wait_for = [&](auto condition) {
      std::unique_lock lock{state.mutex};
      return state.cv.wait_for(lock, 10s, [&] { return condition() || state.closed; }) &&
             !state.closed;
    };
    // [wait]

    // [connect]
    backend->open_active_endpoint(server,
                                  {.send_buffered_params = {.buf_size = *size + 8, .num_buf = 64}});
    if (!wait_for([&] { return state.connected; })) return 1;
    if (copy && !state.can_copy) {
      fmt::print("{} cannot send copies (capabilities.send_copy is false): sending buffered\n",
                 *type);
      copy = false;
    }
    // [connect]

    // [send_loop]
    std::vector<std::uint8_t> payload(*size);
    NetworkBuffer* buffer = nullptr;  // lent to us, filled, not yet accepted by send_buffer
    for (std::uint64_t seq = 0; seq < *messages; ++seq) {
      std::memset(payload.data(), static_cast<int>(seq & 0xFFU), payload.size());
      for (;;) {
        std::uint64_t ready_seen = 0;
        {
          const std::lock_guard lock{state.mutex};
          ready_seen = state.ready;  // read before the send: no callback can be missed
        }
        NetioStatus status = NetioStatus::NO_RESOURCES;
        if (copy) {
          const std::span<const std::uint8_t> header{reinterpret_cast<std::uint8_t*>(&seq),
                                                     sizeof seq};
          status = backend->send_data_copy(server, payload, header, seq);
        } else {
          if (buffer == nullptr && (buffer = backend->get_buffer(server)) != nullptr) {
            buffer->write(seq);  // the integral overload: 8 bytes, host byte order
            buffer->write(std::span<const std::uint8_t>{payload});
          }
          // Refused: the buffer is still lent to us and is sent again next time round.
          if (buffer != nullptr) status = backend->send_buffer(server, buffer);
          if (status == NetioStatus::OK) buffer = nullptr;
        }
        if (status == NetioStatus::OK) break;
        if (status == NetioStatus::FAILED) {
          fmt::print("message {} FAILED\n", seq);
          return 1;
        }
        // NO_RESOURCES, or no free buffer: on_ready_to_send_cb will say when to try again.
        if (!wait_for([&] { return state.ready > ready_seen; })) return 1;
      }
    }
    // [send_loop]

    // [finish]
    if (!wait_for([&] { return state.completed == *messages; })) return 1;
    backend->close_active_endpoint(server);
    {
      std::unique_lock lock{state.mutex};
      state.cv.wait_for(lock, 10s, [&] { return state.closed; });
    }
    loop->stop();
    loop_thread.join();  // the loop has stopped: nothing runs on it any more
    fmt::print("OK: {} messages sent {}, {} completed, {} cancelled\n", *messages,
               copy ? "as copies" : "buffered", state.completed, state.cancelled);
    // [finish]
    return state.completed == *messages && state.cancelled == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print("FAILED: {}\n", e.what());
    return 1;
  }
}
