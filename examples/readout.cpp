// example_readout: a detector readout as a DAQ system writes one - it streams fragments to
// an event builder (example_event_builder), then closes once every send completed.
//
// Each fragment carries its sequence number twice: in the 8-byte header (header_data, or the
// first 8 bytes of a buffer) and in the first 8 bytes of the payload, whose last byte is the
// sequence number's low byte; the builder checks all three. The rest of the payload is left
// as it is (a readout does not rewrite a whole fragment per send either).
//
// Run: example_readout --port PORT [--backend asyncmsg] [--mode tcp] [--ip 127.0.0.1]
//                      [--fragments 10000] [--seconds 0] [--size 4096]
//                      [--send zero-copy|buffered] [--slots 64] [--acknowledged 0|1]
//                      [--close-after-send 0|1] [--session 0|1]
// --acknowledged 1: the builder acknowledges what it was handed (a completion means it has
// the fragment); --close-after-send 1 with it: close right after the last send, not after
// its completion - the close drains, and the completions still come. --session 1 (asyncmsg):
// acknowledged, and a cut connection is resumed rather than closed (docs/sessions.md).
// --seconds N sends for N seconds instead of --fragments. Prints, when the connection closed,
// "sent S, completed C, cancelled X" and the rate. Exit status 0 if the connection was made
// and every send completed (none cancelled), 1 otherwise.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;
using Clock = std::chrono::steady_clock;

namespace {

// The sequence number in the payload's first 8 bytes and its low byte in the last one.
void stamp(std::span<std::uint8_t> payload, std::uint64_t seq) {
  std::memcpy(payload.data(), &seq, std::min(sizeof seq, payload.size()));
  if (payload.size() > sizeof seq) payload.back() = static_cast<std::uint8_t>(seq & 0xFFU);
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = example::Options::parse(argc, argv,
                                               {{"mode", "tcp"},
                                                {"ip", "127.0.0.1"},
                                                {"port", "0"},
                                                {"fragments", "10000"},
                                                {"seconds", "0"},
                                                {"size", "4096"},
                                                {"send", "zero-copy"},
                                                {"slots", "64"},
                                                {"acknowledged", "0"},
                                                {"close-after-send", "0"},
                                                {"session", "0"}});
  if (!options) return 2;
  const auto type = options->backend();
  const auto mode = parse_network_mode(options->str("mode"));
  const auto port = options->number<std::uint16_t>("port");
  const auto fragments = options->number<std::uint64_t>("fragments");
  const auto seconds = options->number<unsigned>("seconds");
  const auto size = options->number<std::size_t>("size");
  const auto slots = options->number<std::size_t>("slots");
  const auto acknowledged = options->number<unsigned>("acknowledged");
  const auto close_after_send = options->number<unsigned>("close-after-send");
  const auto session = options->number<unsigned>("session");
  const std::string& send = options->str("send");
  if (!type || !mode || !port || !fragments || !seconds || !size || !slots || !acknowledged ||
      !close_after_send || !session) {
    return 2;
  }
  if (*port == 0 || *slots == 0 || *size < sizeof(std::uint64_t) ||
      (*fragments == 0 && *seconds == 0) || (send != "zero-copy" && send != "buffered")) {
    std::fprintf(stderr,
                 "--port and --slots must not be 0, --size at least 8, one of --fragments and "
                 "--seconds set, --send zero-copy or buffered\n");
    return 2;
  }
  const bool zero_copy = send == "zero-copy";
  const EndPointAddress builder{options->str("ip"), *port};

  try {
    // Zero-copy: --slots slots of --size bytes; slot i % slots stays untouched until the
    // send of fragment i completed. Buffered: the backend's --slots buffers.
    std::vector<std::uint8_t> region(zero_copy ? *slots * *size : 0);
    std::vector<bool> slot_busy(*slots, false);
    std::uint64_t next = 0;  // the next fragment's sequence number
    std::uint64_t completed = 0;
    std::uint64_t cancelled = 0;
    NetworkBuffer* held = nullptr;  // buffered: a filled buffer refused with NO_RESOURCES
    bool stopping = false;          // no more sends: close once everything completed
    bool failed = false;
    Clock::time_point first{};
    Clock::time_point until{};
    auto loop = std::make_shared<EpollEventLoop>();
    std::unique_ptr<NetworkBackend> backend;

    const auto done_sending = [&] {
      if (stopping) return true;
      if (*seconds != 0 ? Clock::now() >= until : next == *fragments) stopping = true;
      return stopping;
    };
    bool closing = false;
    const auto close = [&] {
      if (!std::exchange(closing, true)) backend->close_active_endpoint(builder);
    };
    const auto close_if_done = [&] {
      if (stopping && (completed == next || *close_after_send != 0)) close();
    };
    // One fragment zero-copy from its slot; NO_RESOURCES also while the slot is busy (its
    // completion calls send_more again).
    const auto send_zero_copy = [&](std::uint64_t seq) {
      const std::size_t slot = seq % *slots;
      if (slot_busy[slot]) return NetioStatus::NO_RESOURCES;
      const std::span<std::uint8_t> payload{region.data() + slot * *size, *size};
      stamp(payload, seq);
      const std::span<const std::uint8_t> header{reinterpret_cast<std::uint8_t*>(&seq), sizeof seq};
      const NetioStatus status = backend->send_data(builder, payload, header, seq);
      if (status == NetioStatus::OK) slot_busy[slot] = true;
      return status;
    };
    // One fragment in one of the backend's buffers. A buffer refused with NO_RESOURCES is
    // still ours and already filled: it is sent again as it is.
    const auto send_buffered = [&](std::uint64_t seq) {
      NetworkBuffer* buffer = std::exchange(held, nullptr);
      if (buffer == nullptr) {
        buffer = backend->get_buffer(builder);
        if (buffer == nullptr) return NetioStatus::NO_RESOURCES;  // all in flight
        if (buffer->available() < sizeof seq + *size) {
          fmt::print("the backend's buffers hold {} bytes, fewer than a fragment\n",
                     buffer->capacity());
          return NetioStatus::FAILED;
        }
        buffer->write(seq);  // the header
        // The payload in place (a readout's DMA would put it there): only the stamp is
        // written, and the buffer told how many bytes are valid.
        stamp({buffer->data() + buffer->size(), *size}, seq);
        buffer->resize(buffer->size() + *size);
      }
      const NetioStatus status = backend->send_buffer(builder, buffer);
      if (status == NetioStatus::NO_RESOURCES) held = buffer;
      return status;
    };
    // Sends until the backend says NO_RESOURCES (a completion or on_ready_to_send_cb calls
    // this again) or no fragment is left; closes once the last send completed.
    const auto send_more = [&] {
      while (!done_sending()) {
        const NetioStatus status = zero_copy ? send_zero_copy(next) : send_buffered(next);
        if (status == NetioStatus::NO_RESOURCES) return;
        if (status == NetioStatus::FAILED) {
          fmt::print("send of fragment {} FAILED\n", next);
          failed = true;
          stopping = true;
          close();
          return;
        }
        ++next;
      }
      close_if_done();
    };

    backend = Netio3Backend::create(
        *type,
        {.mode = *mode,
         .on_connection_established_cb =
             [&](const EndPointAddress& remote, EndpointCapabilities) {
               fmt::print("connected to {}\n", remote);
               std::fflush(stdout);
               first = Clock::now();
               until = first + std::chrono::seconds{*seconds};
               send_more();
             },
         .on_connection_closed_cb =
             [&](const EndPointAddress& remote, const std::vector<std::uint64_t>& keys) {
               cancelled = keys.size();
               const double secs = std::chrono::duration<double>(Clock::now() - first).count();
               fmt::print("connection to {} closed: sent {}, completed {}, cancelled {}\n", remote,
                          next, completed, cancelled);
               fmt::print("rate: {:.1f} MB/s, {:.0f} fragments/s\n",
                          static_cast<double>(completed * *size) / secs / 1e6,
                          static_cast<double>(completed) / secs);
               loop->stop();
             },
         .on_send_completed_cb =
             [&](const EndPointAddress&, std::uint64_t key) {
               ++completed;
               if (zero_copy) slot_busy[key % *slots] = false;
               send_more();
             },
         .on_ready_to_send_cb = [&](const EndPointAddress&) { send_more(); },
         .on_connection_refused_reason_cb =
             [&](const EndPointAddress& remote, const RefusalReason& reason) {
               fmt::print("connection to {} refused ({}): {}\n", remote, reason.cause,
                          reason.message);
               failed = true;
               loop->stop();
             },
         // --session 1: a cut is reported, the connection stays; nothing else to do.
         .on_connection_interrupted_cb =
             [&](const EndPointAddress& remote, const std::string& reason) {
               fmt::print("connection to {} interrupted: {}\n", remote, reason);
               std::fflush(stdout);
             },
         .on_connection_resumed_cb =
             [&](const EndPointAddress& remote, std::chrono::milliseconds outage) {
               fmt::print("connection to {} resumed after {} ms\n", remote, outage.count());
               std::fflush(stdout);
             }},
        loop);
    ConnectionParameters params{};
    // --acknowledged 1: a completion means the builder was handed the fragment.
    params.delivery.acknowledged = *acknowledged != 0;
    // --session 1: a cut connection is resumed, every fragment delivered once.
    params.delivery.session.enabled = *session != 0;
    if (zero_copy) {
      params.send_zero_copy_params = {.buf_size = region.size(), .mr_start = region.data()};
    } else {
      params.send_buffered_params = {.buf_size = *size + sizeof(std::uint64_t), .num_buf = *slots};
    }
    backend->open_active_endpoint(builder, params);
    loop->run();  // until the connection closed
    if (failed || cancelled != 0 || completed != next) return 1;
  } catch (const std::exception& e) {
    fmt::print("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
