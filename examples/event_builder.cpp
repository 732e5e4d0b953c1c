// example_event_builder: the receiving end of a DAQ system - an event builder that takes
// fragments from several readouts (example_readout), checks each readout's sequence and
// stamps, and stops once --readouts connections have closed.
//
// A plain program of the user guide's shape: default allocator, one loop thread, the
// fragment looked at inside on_data_from_cb and not kept.
//
// Run: example_event_builder [--backend asyncmsg] [--mode tcp] [--ip 127.0.0.1] [--port 0]
//                            [--readouts 1] [--size 4096] [--buffers 64] [--expect 0]
//                            [--shared no]
// --size is the largest fragment payload the readouts send; --buffers the receive buffers
// per connection (--shared yes: one pool of --buffers x --readouts for the listener's
// connections); --expect N
// also requires N fragments from each readout. Prints "listening on IP:PORT" first, a line
// per readout "READOUT IP:PORT: N fragments in order" (or what went wrong), then
// "received N fragments, B bytes" and the rate between the first and the last fragment.
// Exit status 0 if every readout's fragments arrived whole, in order (and --expect of each),
// 1 otherwise.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;
using Clock = std::chrono::steady_clock;

namespace {

struct Readout {
  std::uint64_t next = 0;  // the sequence number expected next
  std::uint64_t bytes = 0;
  std::string problem;  // the first thing that was wrong, if any
};

std::uint64_t load_u64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A fragment is the 8-byte header (the sequence number), then the payload: the sequence
// number again in its first 8 bytes and its low byte in its last.
void check(Readout& r, std::span<const std::uint8_t> data) {
  constexpr std::size_t SEQ = sizeof(std::uint64_t);
  const std::uint64_t expected = r.next++;
  r.bytes += data.size();
  if (!r.problem.empty()) return;
  if (data.size() < 2 * SEQ) {
    r.problem = fmt::format("fragment {} has {} bytes", expected, data.size());
  } else if (const auto seq = load_u64(data.data()); seq != expected) {
    r.problem = fmt::format("fragment {} arrived where {} was expected", seq, expected);
  } else if (load_u64(data.data() + SEQ) != expected ||
             (data.size() > 2 * SEQ && data.back() != static_cast<std::uint8_t>(expected))) {
    r.problem = fmt::format("fragment {}: its payload is not what was sent", expected);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = example::Options::parse(argc, argv,
                                               {{"mode", "tcp"},
                                                {"ip", "127.0.0.1"},
                                                {"port", "0"},
                                                {"readouts", "1"},
                                                {"size", "4096"},
                                                {"buffers", "64"},
                                                {"expect", "0"},
                                                {"shared", "no"}});
  if (!options) return 2;
  const auto type = options->backend();
  const auto mode = parse_network_mode(options->str("mode"));
  const auto port = options->number<std::uint16_t>("port");
  const auto readouts = options->number<unsigned>("readouts");
  const auto size = options->number<std::size_t>("size");
  const auto buffers = options->number<std::size_t>("buffers");
  const auto expect = options->number<std::uint64_t>("expect");
  const bool shared = options->str("shared") == "yes";
  if (!type || !mode || !port || !readouts || !size || !buffers || !expect) return 2;
  if (*readouts == 0 || *buffers == 0) {
    std::fprintf(stderr, "--readouts and --buffers must not be 0\n");
    return 2;
  }

  try {
    std::map<EndPointAddress, Readout> from;  // loop thread only
    std::vector<EndPointAddress> order;       // in the order they closed
    std::uint64_t fragments = 0;
    std::uint64_t bytes = 0;
    Clock::time_point first{};
    Clock::time_point last{};

    auto loop = std::make_shared<EpollEventLoop>();
    // A fragment is the header's 8 bytes plus at most --size.
    const std::size_t largest = *size + sizeof(std::uint64_t);
    auto backend = Netio3Backend::create(
        *type,
        {.mode = *mode,
         .on_connection_established_cb = [&](const EndPointAddress& remote,
                                             EndpointCapabilities) { from[remote] = Readout{}; },
         .on_connection_closed_cb =
             [&](const EndPointAddress& remote, const std::vector<std::uint64_t>&) {
               order.push_back(remote);
               if (order.size() == *readouts) loop->stop();
             },
         .on_data_from_cb =
             [&](const EndPointAddress& remote, std::span<const std::uint8_t> data) {
               last = Clock::now();
               if (fragments++ == 0) first = last;
               bytes += data.size();
               check(from[remote], data);
             }},
        loop);
    const auto listening = backend->open_listen_endpoint(
        {options->str("ip"), *port},
        {.recv_params = {.buf_size = largest,
                         .num_buf = shared ? *buffers * *readouts : *buffers,
                         .use_shared_receive_buffers = shared}});
    fmt::print("listening on {}\n", listening);
    std::fflush(stdout);
    loop->run();  // until the last readout closed

    bool ok = true;
    for (const auto& remote : order) {
      const Readout& r = from[remote];
      std::string verdict = r.problem.empty() ? "in order" : r.problem;
      if (*expect != 0 && r.next != *expect && r.problem.empty()) {
        verdict = fmt::format("of {} expected: WRONG COUNT", *expect);
      }
      if (verdict != "in order") ok = false;
      fmt::print("READOUT {}: {} fragments {}\n", remote, r.next, verdict);
    }
    const double secs = std::chrono::duration<double>(last - first).count();
    fmt::print("received {} fragments, {} bytes\n", fragments, bytes);
    if (fragments > 1 && secs > 0) {
      fmt::print("rate: {:.1f} MB/s, {:.0f} fragments/s\n", static_cast<double>(bytes) / secs / 1e6,
                 static_cast<double>(fragments) / secs);
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print("FAILED: {}\n", e.what());
    return 1;
  }
}
