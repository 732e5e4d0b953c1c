// example_guide_errors: the user guide's program on errors (docs/guide.md, "Errors"). Each
// kind of error netio3 reports, made to happen once and handled:
//  - exceptions from calls that cannot be carried out (all derive from NetioException);
//  - send statuses: NO_RESOURCES (not now) and FAILED (never), and what each leaves you;
//  - a connection that cannot be set up: on_connection_refused_reason_cb with the cause;
//  - an exception escaping a callback: logged, and the backend carries on.
// Prints one line per case, "ok" or "WRONG".
//
// Run: example_guide_errors [--backend asyncmsg] [--mode tcp]
// Exit status 0 if every case behaved as the guide says.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

#include "example_support.hpp"

using namespace netio3;
using namespace std::chrono_literals;

namespace {

int wrong = 0;

void check(bool ok, std::string_view what) {
  fmt::print("{}: {}\n", ok ? "ok" : "WRONG", what);
  if (!ok) ++wrong;
}

// Runs `call` and says whether it threw E; prints the exception's text.
template <typename E, typename F>
bool throws(F call) {
  try {
    call();
  } catch (const E& e) {
    fmt::print("  {}\n", e.what());
    return true;
  } catch (const std::exception& e) {
    fmt::print("  another exception: {}\n", e.what());
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = example::Options::parse(argc, argv, {{"mode", "tcp"}});
  if (!options) return 2;
  const auto type = options->backend();
  const auto mode = parse_network_mode(options->str("mode"));
  if (!type || !mode) return 2;

  try {
    std::mutex mutex;
    std::condition_variable cv;
    std::optional<RefusalReason> refusal;
    int established = 0;
    bool can_copy = false;
    std::uint64_t completed = 0;
    const auto wait_for = [&](auto condition) {
      std::unique_lock lock{mutex};
      return cv.wait_for(lock, 10s, condition);
    };
    // [refused]
    auto loop = std::make_shared<EpollEventLoop>();
    auto backend = Netio3Backend::create(
        *type,
        {.mode = *mode,
         .on_data_cb =
             [](std::span<const std::uint8_t>) {
               // An exception escaping a callback is caught and logged (error level).
               throw std::runtime_error("the application's own bug");
             },
         .on_connection_established_cb =
             [&](const EndPointAddress&, EndpointCapabilities capabilities) {
               const std::lock_guard lock{mutex};
               can_copy = capabilities.send_copy;
               ++established;
               cv.notify_all();
             },
         .on_send_completed_cb =
             [&](const EndPointAddress&, std::uint64_t) {
               const std::lock_guard lock{mutex};
               ++completed;
               cv.notify_all();
             },
         .on_connection_refused_reason_cb =
             [&](const EndPointAddress& remote, const RefusalReason& reason) {
               fmt::print("  {} refused ({}): {}\n", remote, reason.cause, reason.message);
               const std::lock_guard lock{mutex};
               refusal = reason;
               cv.notify_all();
             }},
        loop);
    // [refused]
    std::jthread loop_thread{[loop] { loop->run(); }};
    const example::StopLoopOnExit stop_loop{loop};

    // [exceptions]
    check(throws<InvalidEndpointAddress>([&] {
            (void)backend->open_listen_endpoint({"localhost", 0}, {});
          }),
          "a host name is not an address (names are never resolved: no call blocks)");
    const auto listening =
        backend->open_listen_endpoint({"127.0.0.1", 0}, {.recv_params = {4096, 16, false}});
    check(throws<ListenEndpointAlreadyExists>(
              [&] { (void)backend->open_listen_endpoint(listening, {}); }),
          "listening twice on one address");
    check(throws<InvalidConnectionParameters>([&] {
            backend->open_active_endpoint(listening, {.send_buffered_params = {0, 16}});
          }),
          "16 send buffers of 0 bytes");
    check(throws<UnknownActiveEndpoint>([&] {
            (void)backend->get_buffer({"127.0.0.1", 1});
          }),
          "a buffer for a connection that does not exist");
    // [exceptions]

    // [statuses]
    std::vector<std::uint8_t> region(4096);
    backend->open_active_endpoint(listening,
                                  {.send_zero_copy_params = {region.size(), region.data()}});
    check(wait_for([&] { return established == 2; }), "connected (both sides)");
    std::vector<std::uint8_t> elsewhere(64);
    check(backend->send_data(listening, elsewhere, {}, 1) == NetioStatus::FAILED,
          "zero-copy from outside the configured region is FAILED, on every backend");
    const std::vector<std::uint8_t> header(17);
    check(backend->send_data(listening, std::span{region}.first(64), header, 2) ==
              NetioStatus::FAILED,
          "header_data over 16 bytes is FAILED");
    check(backend->send_data(listening, std::span{region}.first(64), {}, 3) == NetioStatus::OK,
          "the same data from inside the region is OK");
    check(wait_for([&] { return completed == 1; }), "and completes once (key 3)");
    // [statuses]

    // [copy]
    const std::vector<std::uint8_t> small(8);
    if (!can_copy) {  // libfabric
      check(throws<NotSupported>([&] { (void)backend->send_data_copy(listening, small, {}, 4); }),
            "a backend that cannot copy (capabilities.send_copy false) throws NotSupported");
    } else {
      check(backend->send_data_copy(listening, small, {}, 4) == NetioStatus::OK &&
                wait_for([&] { return completed == 2; }),
            "send_data_copy is OK and completes; the receiver's exception did not stop it");
    }
    // [copy]

    // [refusal]
    // A port that was free a moment ago: nothing listens there now.
    const auto gone = backend->open_listen_endpoint({"127.0.0.1", 0}, {});
    backend->close_listen_endpoint(gone);
    backend->open_active_endpoint(gone, {.send_buffered_params = {4096, 16}});
    check(wait_for([&] { return refusal.has_value(); }) &&
              refusal->cause == RefusalCause::UNREACHABLE,
          "connecting where nothing listens: on_connection_refused_reason_cb, unreachable");
    // [refusal]
  } catch (const std::exception& e) {
    fmt::print("FAILED: {}\n", e.what());
    return 1;
  }
  fmt::print("{}\n", wrong == 0 ? "OK: every error as documented" : "FAILED");
  return wrong == 0 ? 0 : 1;
}
