// example_guide_timers: the user guide's program for timers, signals and Ctrl-C
// (docs/guide.md, "Timers, signals and Ctrl-C"). One process listens and connects to itself;
// a timer sends a message every 10 ms, a second one prints the backend's statistics every
// --tick milliseconds, and Ctrl-C (SIGINT, or SIGTERM) stops it cleanly: the connection is
// closed, its closed callback stops the loop, and main returns 0. No thread of its own.
//
// Run: example_guide_timers [--backend asyncmsg] [--tick 200]
// Prints "listening on IP:PORT", a line "tick N: ..." per tick, and "stopping (signal N)"
// then "closed: ..." after Ctrl-C.

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <span>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;

namespace {
// [signal]
// What a POSIX signal handler may touch: fire() is async-signal-safe (a write to an eventfd);
// its callback then runs on the loop thread, where everything netio3 may be called.
const EventSignalHandle* g_stop = nullptr;
std::atomic<int> g_signal{0};

extern "C" void on_stop_signal(int signo) {
  g_signal.store(signo);
  if (g_stop != nullptr) g_stop->fire();
}
// [signal]
}  // namespace

int main(int argc, char** argv) {
  const auto options = example::Options::parse(argc, argv, {{"tick", "200"}});
  if (!options) return 2;
  const auto type = options->backend();
  const auto tick_ms = options->number<unsigned>("tick");
  if (!type || !tick_ms || *tick_ms == 0) return 2;

  try {
    // [program]
    auto loop = std::make_shared<EpollEventLoop>();
    std::unique_ptr<NetworkBackend> backend;
    EndPointAddress server;
    bool connected = false;
    bool closing = false;
    std::uint64_t next = 0;
    backend = Netio3Backend::create(
        *type,
        {.mode = NetworkMode::TCP,
         .on_connection_established_cb =
             [&](const EndPointAddress& remote, EndpointCapabilities) {
               if (remote == server) connected = true;
             },
         .on_connection_closed_cb =
             [&](const EndPointAddress& remote, const std::vector<std::uint64_t>& cancelled) {
               if (remote != server) return;  // the accepted side of the same connection
               fmt::print("closed: {} messages sent, {} cancelled\n", next, cancelled.size());
               loop->stop();
             }},
        loop);
    // libfabric receives into buffers the endpoint is given; the others need none.
    server = backend->open_listen_endpoint({"127.0.0.1", 0},
                                           {.recv_params = {.buf_size = 64, .num_buf = 16}});
    fmt::print("listening on {}\n", server);
    std::fflush(stdout);
    backend->open_active_endpoint(server,
                                  {.send_buffered_params = {.buf_size = 64, .num_buf = 16}});

    // A timer runs its callback on the loop thread every period, until stop().
    EventTimerHandle sender = loop->create_timer([&] {
      if (!connected || closing) return;
      if (NetworkBuffer* buffer = backend->get_buffer(server)) {
        buffer->write(next);
        if (backend->send_buffer(server, buffer) == NetioStatus::OK) ++next;
      }
    });
    sender.start(std::chrono::milliseconds{10});

    // A statistics tick: statistics() and backend_statistics() may be called from any thread;
    // here they run on the loop, between two events.
    std::uint64_t ticks = 0;
    EventTimerHandle stats = loop->create_timer([&] {
      const BackendStatistics s = backend->backend_statistics();
      fmt::print("tick {}: {} open, {} sent, {} completed, {} received\n", ++ticks,
                 s.connections_open, s.sends_accepted, s.sends_completed, s.messages_received);
      std::fflush(stdout);
    });
    stats.start(std::chrono::milliseconds{*tick_ms});

    // Ctrl-C: the handler fires a loop signal; its callback closes on the loop thread, and the
    // closed callback stops the loop once the connection is down.
    EventSignalHandle stop = loop->create_signal([&] {
      if (closing) return;
      closing = true;
      fmt::print("stopping (signal {})\n", g_signal.load());
      std::fflush(stdout);
      sender.stop();
      stats.stop();
      backend->close_active_endpoint(server);
    });
    g_stop = &stop;
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);

    loop->run();  // until the closed callback stops it
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    g_stop = nullptr;
    // [program]
  } catch (const std::exception& e) {
    fmt::print("FAILED: {}\n", e.what());
    return 1;
  }
  return 0;
}
