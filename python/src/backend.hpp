#pragma once

// netio3.NetworkBackend for Python: the C++ backend, the Python callbacks it calls, and the
// Python buffers it holds while the transport may read them.
//
// Everything below the GIL line (State) is touched with the GIL held only: by the callbacks
// (which run on the loop's thread inside a round, with the GIL) and by the API calls (Python
// code). The C++ backend itself is called with the GIL held, except where it may wait for
// the loop's thread (destruction and run_sync-like calls from another thread): then the GIL
// is released first, so the loop's thread can finish the round it needs the GIL for.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <netio3/netio3.hpp>

#include "loop.hpp"
#include "support.hpp"

namespace netio3::python {

class PyNetworkBuffer;

// How received data reaches Python.
enum class Receive : std::uint8_t {
  BYTES,      // a bytes copy (default)
  MEMORYVIEW  // a read-only memoryview of netio3's buffer, released when the callback returns
};

// The Python side of a NetworkConfig: plain values plus Python callables.
struct PyConfig {
  NetworkMode mode{NetworkMode::TCP};
  ThreadSafetyModel thread_safety{ThreadSafetyModel::SAFE};
  SharedReceiveBuffers shared_receive_buffers{};
  SharedSendBuffers shared_send_buffers{};
  py::object on_data_cb = py::none();
  py::object on_connection_established_cb = py::none();
  py::object on_connection_closed_cb = py::none();
  py::object on_connection_refused_cb = py::none();
  py::object on_send_completed_cb = py::none();
  NetworkLimits limits{};
  py::object on_ready_to_send_cb = py::none();
  py::object on_data_from_cb = py::none();
  py::object on_connection_refused_reason_cb = py::none();
  Receive receive{Receive::BYTES};
  // Admission (docs/admission.md): the partition key and the identity this side presents.
  std::string partition_key;
  std::string identity;
  py::object on_accept_cb = py::none();  // on_accept_cb(PeerInfo) -> AcceptDecision | bool
  py::object on_connection_closed_reason_cb = py::none();  // (remote, cancelled_keys, reason)
  py::object on_connection_interrupted_cb = py::none();    // (remote, reason): sessions
  py::object on_connection_resumed_cb = py::none();        // (remote, outage in seconds)
};

// What the Python side keeps per connection (created when it is established, or at the
// first send that needs it; dropped at its closed callback).
struct Connection {
  py::object address;  // netio3.EndPointAddress, made once
  // Zero-copy sends in flight: their payload (and header) objects, by key.
  std::unordered_map<std::uint64_t, std::vector<HeldBuffer>> in_flight;
  // Buffers lent by get_buffer and not sent: invalid after the closed callback.
  std::unordered_set<PyNetworkBuffer*> lent;
};

struct State {
  bool alive{true};  // false once the backend is being destroyed: no callback reaches Python
  Receive receive{Receive::BYTES};
  SharedRef on_data, on_data_from, established, closed, closed_reason, refused, refused_reason,
      completed, ready;
  SharedRef accept;
  SharedRef interrupted, resumed;
  std::unordered_map<EndPointAddress, Connection> connections;
  // Zero-copy regions (send_zero_copy_params from a Python object): an active endpoint's
  // until its connection ends; a listen endpoint's until the backend goes (its connections
  // use it).
  std::unordered_map<EndPointAddress, HeldBuffer> active_regions;
  std::vector<HeldBuffer> listener_regions;

  Connection& connection(const EndPointAddress& remote);
  py::object address_of(const EndPointAddress& remote);
  // Releases what a connection that ended held, invalidates its lent buffers; returns its
  // Python address.
  py::object end_connection(const EndPointAddress& remote);
};

// A buffer lent by get_buffer: valid until it is sent (send_buffer returned OK) or its
// connection closed.
class PyNetworkBuffer {
 public:
  PyNetworkBuffer(std::shared_ptr<State> state, EndPointAddress remote, NetworkBuffer* buffer)
      : m_state{std::move(state)}, m_remote{std::move(remote)}, m_buffer{buffer} {}
  ~PyNetworkBuffer();
  PyNetworkBuffer(const PyNetworkBuffer&) = delete;
  PyNetworkBuffer& operator=(const PyNetworkBuffer&) = delete;
  PyNetworkBuffer(PyNetworkBuffer&&) = delete;
  PyNetworkBuffer& operator=(PyNetworkBuffer&&) = delete;

  // The buffer, or throws ValueError when it is no longer the application's.
  NetworkBuffer& get() const;
  [[nodiscard]] NetworkBuffer* raw() const noexcept { return m_buffer; }
  [[nodiscard]] const EndPointAddress& remote() const noexcept { return m_remote; }
  // No longer the application's: sent, or its connection closed.
  void invalidate(const char* why) noexcept {
    m_buffer = nullptr;
    m_why = why;
  }

 private:
  std::shared_ptr<State> m_state;
  EndPointAddress m_remote;
  NetworkBuffer* m_buffer;
  const char* m_why{""};
};

class Backend {
 public:
  Backend(BackendType type, PyConfig config, std::shared_ptr<Loop> loop);
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  Backend(Backend&&) = delete;
  Backend& operator=(Backend&&) = delete;

  // Destroys the C++ backend now (as its destructor): closes everything without callbacks.
  void close();

  py::object open_listen_endpoint(py::handle address, py::handle params);
  void open_active_endpoint(py::handle address, py::handle params);
  void close_listen_endpoint(py::handle address);
  void close_active_endpoint(py::handle address);
  py::object get_buffer(py::handle address);
  NetioStatus send_buffer(py::handle address, PyNetworkBuffer& buffer);
  NetioStatus send_data(py::handle address, py::handle data, py::handle header, std::uint64_t key);
  NetioStatus send_data_copy(py::handle address, py::handle data, py::handle header,
                             std::uint64_t key);
  [[nodiscard]] ConnectionStatistics statistics(py::handle address);
  [[nodiscard]] std::vector<ConnectionStatistics> connection_statistics();
  [[nodiscard]] BackendStatistics backend_statistics();
  [[nodiscard]] BackendType type() const;
  [[nodiscard]] const std::shared_ptr<Loop>& loop() const noexcept { return m_loop; }

 private:
  NetworkBackend& get() const;
  // The connection parameters of a Python ConnectionParameters; a zero-copy region given as
  // a Python object is held in `region`.
  ConnectionParameters parameters(py::handle params, std::optional<HeldBuffer>& region) const;
  // After an API call that succeeded: the loop must run a round soon (Loop::note_api_call).
  void called() const { m_loop->note_api_call(); }

  std::shared_ptr<Loop> m_loop;
  std::shared_ptr<State> m_state;
  std::unique_ptr<NetworkBackend> m_backend;
};

void bind_backend(py::module_& m);

}  // namespace netio3::python
