// example_guide_receiver: the receiver of the user guide's first program (docs/guide.md).
// Listens, receives messages from any number of senders, tells them apart with
// on_data_from_cb and checks that each sender's messages arrive in order; stops once
// --senders connections have closed.
//
// Every message starts with the 8-byte sequence number its sender put into header_data.
//
// Run: example_guide_receiver [--backend asyncmsg] [--mode tcp] [--ip 127.0.0.1] [--port 0]
//                             [--senders 1] [--size 4096]
// Prints "listening on IP:PORT" first, and for each sender "SENDER: N messages in order".
// Exit status 0 if every sender's messages arrived in order; 1 otherwise.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;

int main(int argc, char** argv) {
  const auto options = example::Options::parse(
      argc, argv,
      {{"mode", "tcp"}, {"ip", "127.0.0.1"}, {"port", "0"}, {"senders", "1"}, {"size", "4096"}});
  if (!options) return 2;
  const auto type = options->backend();
  const auto mode = parse_network_mode(options->str("mode"));
  const auto port = options->number<std::uint16_t>("port");
  const auto senders = options->number<unsigned>("senders");
  const auto size = options->number<std::size_t>("size");
  if (!type || !mode || !port || !senders || !size) return 2;

  try {
    // [receiver]
    struct Sender {
      std::uint64_t next = 0;  // the sequence number expected next
      bool in_order = true;
    };
    std::map<EndPointAddress, Sender> from;  // only touched on the loop thread
    unsigned closed = 0;

    auto loop = std::make_shared<EpollEventLoop>();
    auto backend = Netio3Backend::create(
        *type,
        {.mode = *mode,
         .on_connection_established_cb =
             [&](const EndPointAddress& remote, EndpointCapabilities) {
               fmt::print("{} connected\n", remote);
               from[remote] = Sender{};
             },
         .on_connection_closed_cb =
             [&](const EndPointAddress& remote, const std::vector<std::uint64_t>&) {
               const Sender& s = from[remote];
               fmt::print("{}: {} messages {}\n", remote, s.next,
                          s.in_order ? "in order" : "OUT OF ORDER");
               if (++closed == *senders) loop->stop();
             },
         // on_data_cb with the sender: which connection the message came from.
         .on_data_from_cb =
             [&](const EndPointAddress& remote, std::span<const std::uint8_t> data) {
               Sender& s = from[remote];
               std::uint64_t seq = 0;
               if (data.size() >= sizeof seq) std::memcpy(&seq, data.data(), sizeof seq);
               if (data.size() < sizeof seq || seq != s.next) s.in_order = false;
               ++s.next;
             }},
        loop);
    // The largest message is the header's 8 bytes plus --size; libfabric receives into these
    // buffers (64 per connection), UCX uses them for large messages, asyncmsg needs none.
    const auto listening = backend->open_listen_endpoint(
        {options->str("ip"), *port},
        {.recv_params = {.buf_size = *size + sizeof(std::uint64_t), .num_buf = 64}});
    fmt::print("listening on {}\n", listening);
    std::fflush(stdout);
    loop->run();  // until the last sender has closed
    // [receiver]

    for (const auto& [remote, s] : from) {
      if (!s.in_order) return 1;
    }
  } catch (const std::exception& e) {
    fmt::print("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
