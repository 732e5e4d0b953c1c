// example_guide_sender: the sender of the user guide's first program (docs/guide.md).
// Connects to example_guide_receiver and sends --messages messages zero-copy from a region
// of --slots slots, driven entirely by callbacks on the loop thread:
//  - on_connection_established_cb starts sending;
//  - a slot may be filled again only once its send completed (on_send_completed_cb);
//  - NO_RESOURCES ("not now") waits for on_ready_to_send_cb instead of retrying on a timer;
//  - when every send completed, the connection is closed; its closed callback stops the loop.
//
// Run: example_guide_sender --port PORT [--backend asyncmsg] [--mode tcp] [--ip 127.0.0.1]
//                           [--messages 10000] [--size 4096] [--slots 16]
// Exit status 0 if the connection was made and every send completed; 1 otherwise.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;

int main(int argc, char** argv) {
  const auto options = example::Options::parse(argc, argv,
                                               {{"mode", "tcp"},
                                                {"ip", "127.0.0.1"},
                                                {"port", "0"},
                                                {"messages", "10000"},
                                                {"size", "4096"},
                                                {"slots", "16"}});
  if (!options) return 2;
  const auto type = options->backend();
  const auto mode = parse_network_mode(options->str("mode"));
  const auto port = options->number<std::uint16_t>("port");
  const auto messages = options->number<std::uint64_t>("messages");
  const auto size = options->number<std::size_t>("size");
  const auto slots = options->number<std::size_t>("slots");
  if (!type || !mode || !port || !messages || !size || !slots) return 2;
  if (*port == 0 || *messages == 0 || *slots == 0) {
    std::fprintf(stderr, "--port, --messages and --slots must not be 0\n");
    return 2;
  }
  const EndPointAddress server{options->str("ip"), *port};

  try {
    // [state]
    // The zero-copy region: --slots slots of --size bytes. The payload of message i is sent
    // from slot i % slots, which must stay untouched until that send's key is reported.
    std::vector<std::uint8_t> region(*slots * *size);
    std::vector<bool> slot_busy(*slots, false);
    std::uint64_t next = 0;       // the next message to send (and its key)
    std::uint64_t completed = 0;  // sends reported by on_send_completed_cb
    std::uint64_t ready = 0;      // on_ready_to_send_cb calls
    bool failed = false;
    std::shared_ptr<EpollEventLoop> loop = std::make_shared<EpollEventLoop>();
    std::unique_ptr<NetworkBackend> backend;
    // [state]

    // [send_more]
    // Sends until a slot is still busy (its completion calls this again) or the backend
    // says NO_RESOURCES (on_ready_to_send_cb calls this again). Loop thread only.
    const auto send_more = [&] {
      while (next < *messages) {
        const std::size_t slot = next % *slots;
        if (slot_busy[slot]) return;
        std::span<std::uint8_t> payload{region.data() + slot * *size, *size};
        std::memset(payload.data(), static_cast<int>(next & 0xFFU), payload.size());
        std::uint64_t seq = next;  // header_data is copied by the call: a local will do
        const std::span<const std::uint8_t> header{reinterpret_cast<std::uint8_t*>(&seq),
                                                   sizeof seq};
        switch (backend->send_data(server, payload, header, next)) {
          case NetioStatus::OK:
            slot_busy[slot] = true;
            ++next;
            break;
          case NetioStatus::NO_RESOURCES:  // not now: on_ready_to_send_cb says when
            return;
          case NetioStatus::FAILED:  // never: give up
            fmt::print("send_data of message {} FAILED\n", next);
            failed = true;
            backend->close_active_endpoint(server);
            return;
        }
      }
    };
    // [send_more]

    // [create]
    backend = Netio3Backend::create(
        *type,
        {.mode = *mode,
         .on_connection_established_cb =
             [&](const EndPointAddress& remote, EndpointCapabilities capabilities) {
               fmt::print("connected to {} (zero-copy: {})\n", remote, capabilities.send_zero_copy);
               send_more();
             },
         .on_connection_closed_cb =
             [&](const EndPointAddress& remote, const std::vector<std::uint64_t>& cancelled) {
               // Every accepted send ends once: completed, or cancelled here.
               fmt::print("connection to {} closed: {} sent, {} completed, {} cancelled\n", remote,
                          next, completed, cancelled.size());
               if (completed != next) failed = true;
               loop->stop();
             },
         .on_send_completed_cb =
             [&](const EndPointAddress&, std::uint64_t key) {
               slot_busy[key % *slots] = false;  // the slot may be written again
               if (++completed == *messages) {
                 backend->close_active_endpoint(server);  // all done
               } else if (key % *slots == next % *slots) {
                 send_more();  // the slot the sender waits for is free
               }
             },
         .on_ready_to_send_cb =
             [&](const EndPointAddress&) {
               ++ready;
               send_more();
             },
         .on_connection_refused_reason_cb =
             [&](const EndPointAddress& remote, const RefusalReason& reason) {
               fmt::print("connection to {} refused ({}): {}\n", remote, reason.cause,
                          reason.message);
               failed = true;
               loop->stop();
             }},
        loop);
    backend->open_active_endpoint(
        server, {.send_zero_copy_params = {.buf_size = region.size(), .mr_start = region.data()}});
    loop->run();  // returns after loop->stop()
    // [create]

    if (failed || completed != *messages) return 1;
    fmt::print("OK: {} messages of {} bytes sent to {} ({} times ready to send again)\n", completed,
               *size, server, ready);
  } catch (const std::exception& e) {
    fmt::print("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
