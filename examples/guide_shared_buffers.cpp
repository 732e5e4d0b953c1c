// example_guide_shared_buffers: the user guide's program for shared buffers (docs/guide.md,
// "Shared buffers"). One process, one backend: it opens --connections listen endpoints and
// connects once to each of them (a backend holds one connection per remote address). Every
// connection sends from one shared pool of 32 send buffers and receives into one shared pool
// of 256 receive buffers, so memory stays the same however many connections there are; the
// statistics show how many send buffers were ever lent out at once.
//
// Run: example_guide_shared_buffers [--backend asyncmsg] [--mode tcp] [--connections 8]
//                                   [--messages 2000] [--size 1024]
// Exit status 0 if every connection's messages arrived in order and every send completed.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;

int main(int argc, char** argv) {
  const auto options = example::Options::parse(
      argc, argv, {{"mode", "tcp"}, {"connections", "8"}, {"messages", "2000"}, {"size", "1024"}});
  if (!options) return 2;
  const auto type = options->backend();
  const auto mode = parse_network_mode(options->str("mode"));
  const auto connections = options->number<unsigned>("connections");
  const auto messages = options->number<std::uint64_t>("messages");
  const auto size = options->number<std::size_t>("size");
  if (!type || !mode || !connections || !messages || !size) return 2;
  if (*connections == 0 || *messages == 0) {
    std::fprintf(stderr, "--connections and --messages must not be 0\n");
    return 2;
  }
  const std::size_t message_size = *size + sizeof(std::uint64_t);  // sequence number first

  try {
    auto loop = std::make_shared<EpollEventLoop>();
    std::unique_ptr<NetworkBackend> backend;
    std::set<EndPointAddress> servers;                  // our listen endpoints
    std::map<EndPointAddress, std::uint64_t> sent;      // per connection we opened
    std::map<EndPointAddress, NetworkBuffer*> refused;  // filled, refused, sent again later
    std::map<EndPointAddress, std::uint64_t> received;  // per connection we accepted
    std::uint64_t completed = 0;
    std::size_t high_water = 0;  // the most shared send buffers lent out at once
    unsigned closed = 0;         // connections closed, both sides counted
    bool in_order = true;
    std::vector<std::uint8_t> payload(*size, 0x5A);

    // [send_more]
    // Sends on `to` until its messages are out or the shared pool is empty: then
    // on_ready_to_send_cb calls this again when a buffer came back (from any connection).
    const auto send_more = [&](const EndPointAddress& to) {
      std::uint64_t& seq = sent[to];
      while (seq < *messages) {
        NetworkBuffer* buffer = std::exchange(refused[to], nullptr);
        if (buffer == nullptr) {
          buffer = backend->get_buffer(to);
          if (buffer == nullptr) return;  // all shared buffers are lent out
          buffer->write(seq);
          buffer->write(std::span<const std::uint8_t>{payload});
        }
        const NetioStatus status = backend->send_buffer(to, buffer);
        if (status == NetioStatus::NO_RESOURCES) {
          refused[to] = buffer;  // still lent to us: sent again when we are called back
          return;
        }
        if (status == NetioStatus::FAILED) {  // never: give up
          in_order = false;
          loop->stop();
          return;
        }
        ++seq;
      }
    };
    // [send_more]

    // [create]
    backend = Netio3Backend::create(
        *type,
        {.mode = *mode,
         // One pool of 256 receive buffers for every connection of this backend (libfabric
         // posts them to a shared receive context; asyncmsg needs none).
         .shared_receive_buffers = {.use_shared_receive_buffers = true,
                                    .buf_size = message_size,
                                    .num_buf = 256},
         // One pool of 32 send buffers for every connection of this backend.
         .shared_send_buffers = {.use_shared_send_buffers = true,
                                 .buf_size = message_size,
                                 .num_buf = 32},
         .on_connection_established_cb =
             [&](const EndPointAddress& remote, EndpointCapabilities) {
               if (servers.contains(remote)) send_more(remote);  // a connection we opened
             },
         .on_connection_closed_cb =
             [&](const EndPointAddress&, const std::vector<std::uint64_t>&) {
               if (++closed == 2 * *connections) loop->stop();  // after the last message
             },
         .on_send_completed_cb =
             [&](const EndPointAddress& remote, std::uint64_t) {
               if (++completed < *connections * *messages) return;
               // [statistics]
               // The shared pool's high-water mark, as any of its connections sees it.
               high_water = backend->statistics(remote).send_buffers_high_water;
               // [statistics]
               for (const auto& to : servers) backend->close_active_endpoint(to);
             },
         .on_ready_to_send_cb = send_more,
         .on_data_from_cb =
             [&](const EndPointAddress& remote, std::span<const std::uint8_t> data) {
               std::uint64_t seq = 0;
               if (data.size() == message_size) std::memcpy(&seq, data.data(), sizeof seq);
               if (data.size() != message_size || seq != received[remote]) in_order = false;
               ++received[remote];
             }},
        loop);
    for (unsigned i = 0; i < *connections; ++i) {
      servers.insert(backend->open_listen_endpoint({"127.0.0.1", 0}, {}));
    }
    for (const auto& server : servers) backend->open_active_endpoint(server, {});
    // [create]

    loop->run();  // until both sides of every connection have closed

    fmt::print("{} connections, {} messages each; at most {} of 32 shared send buffers in use\n",
               *connections, *messages, high_water);
    std::uint64_t total_received = 0;
    for (const auto& [remote, n] : received) total_received += n;
    if (!in_order || completed != *connections * *messages ||
        total_received != *connections * *messages) {
      fmt::print("FAILED: in order {}, {} completed, {} received\n", in_order, completed,
                 total_received);
      return 1;
    }
    fmt::print("OK\n");
  } catch (const std::exception& e) {
    fmt::print("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
