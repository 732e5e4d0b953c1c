#pragma once

// The conformance suite: written once, instantiated for every backend compiled in. What a
// backend can and cannot do is described by its BackendTraits; tests that need a missing
// capability are skipped with the reason, never silently passed.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

#include "test_support.hpp"

namespace netio3::conformance {

using test::Recorder;
using Kind = test::Recorder::Kind;

enum class SendMode { BUFFERED, ZERO_COPY, COPY };
[[nodiscard]] std::string_view to_string(SendMode mode);

struct BackendTraits {
  BackendType type;
  NetworkMode mode;
  bool copy_supported;                // send_data_copy works (else NotSupported)
  bool zero_copy_needs_region;        // send_data only from [mr_start, mr_start + buf_size)
  bool buffered_zero_copy_exclusive;  // one endpoint cannot do both
  bool honours_unsafe;                // UNSAFE really drops locking (and checks the caller)
  bool receive_needs_buffers;         // messages are limited by recv_params.buf_size
};

[[nodiscard]] const BackendTraits& traits(BackendType type);

// Every backend compiled in.
[[nodiscard]] std::vector<BackendType> backends();

// The parameters of the suites that run every backend x send mode x thread-safety model.
struct ModeParam {
  BackendType backend;
  SendMode mode;
  ThreadSafetyModel model;
  bool session{false};  // the client's acknowledged connections have a session (asyncmsg)
};
[[nodiscard]] std::vector<ModeParam> mode_params();
// mode_params() and, for the backends with sessions, each once more with session.
[[nodiscard]] std::vector<ModeParam> mode_params_with_sessions();
[[nodiscard]] std::string mode_param_name(const testing::TestParamInfo<ModeParam>& info);

inline constexpr std::size_t BUF_SIZE = 4096;
inline constexpr std::size_t NUM_BUF = 16;
inline constexpr std::size_t LARGE = std::size_t{256} << 10U;

// One side: a recorder, a loop on its own thread, and a backend (destroyed first).
class Node {
 public:
  Node(BackendType type, ThreadSafetyModel model,
       const std::function<void(NetworkConfig&)>& tweak = {},
       Recorder::Callbacks callbacks = Recorder::Callbacks::DOCUMENTED);
  ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
  Node(Node&&) = delete;
  Node& operator=(Node&&) = delete;

  // Runs f where the thread-safety model allows API calls: directly for SAFE, on the
  // loop thread (run_sync) for UNSAFE. Exceptions propagate to the caller.
  template <typename F>
  auto call(F&& f) -> std::invoke_result_t<F> {
    using R = std::invoke_result_t<F>;
    if (model == ThreadSafetyModel::SAFE) return f();
    if constexpr (std::is_void_v<R>) {
      loop.loop()->run_sync(std::forward<F>(f));
    } else {
      std::optional<R> result;
      loop.loop()->run_sync([&] { result.emplace(f()); });
      return std::move(*result);
    }
  }

  // Destroys the backend now (the loop keeps running).
  void destroy_backend();

  const BackendType type;
  const ThreadSafetyModel model;
  const BackendTraits& traits;
  Recorder rec;
  test::LoopThread loop;
  std::unique_ptr<NetworkBackend> backend;
};

// Parameters for an endpoint that sends in `mode` with the given zero-copy region and
// buffers of `buf_size`, and receives messages of up to `recv_size` bytes.
[[nodiscard]] ConnectionParameters sender_params(const BackendTraits& traits, SendMode mode,
                                                 std::span<std::uint8_t> region,
                                                 std::size_t buf_size = BUF_SIZE,
                                                 std::size_t recv_size = BUF_SIZE);
// Parameters of a listen endpoint whose connections receive (and can send buffered).
[[nodiscard]] ConnectionParameters receiver_params(std::size_t max_message);

// Waits until both sides saw the connection established. Returns the server-side remote
// address of the client (how the server addresses this connection).
[[nodiscard]] std::optional<EndPointAddress> wait_connected(Node& client, Node& server,
                                                            const EndPointAddress& listen);

// Sends message `index` (its bytes are `message`) in `mode`, retrying on NO_RESOURCES
// after waiting for a completion. For ZERO_COPY the payload must already sit in `region`
// at `offset`. Returns the final status (OK, or FAILED) and, through `key`, the key.
NetioStatus send_one(Node& node, const EndPointAddress& to, SendMode mode,
                     std::span<const std::uint8_t> message, std::span<std::uint8_t> region,
                     std::uint64_t index, std::uint64_t* key = nullptr);
// One attempt of send_one: NO_RESOURCES is returned, not retried.
NetioStatus try_send(Node& node, const EndPointAddress& to, SendMode mode,
                     std::span<const std::uint8_t> message, std::span<std::uint8_t> region,
                     std::uint64_t index, std::uint64_t* key = nullptr);

}  // namespace netio3::conformance
