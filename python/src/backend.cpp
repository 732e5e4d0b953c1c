#include "backend.hpp"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <string>
#include <utility>

namespace netio3::python {
namespace {

// Python's ConnectionParameters: the C++ structs, with the zero-copy region as a Python
// object that lends its memory (buffer protocol) instead of a pointer.
struct PyConnectionParameters {
  RecvParameters recv_params{};
  SendBufferedParameters send_buffered_params{};
  py::object send_zero_copy_params = py::none();  // SendZeroCopyParameters or None
  DeliveryParameters delivery{};
};

struct PySendZeroCopyParameters {
  py::object region = py::none();  // a writable C-contiguous buffer (bytearray, numpy, mmap)
};

// Calls a Python callback from a C++ one; GIL taken, nothing once the backend is going.
template <typename F>
void with_python(State* s, F&& f) {
  const py::gil_scoped_acquire gil;
  if (!s->alive) return;
  f();
}

void deliver(State* s, const EndPointAddress* remote, std::span<const std::uint8_t> data) {
  with_python(s, [&] {
    const auto* bytes = reinterpret_cast<const char*>(data.data());  // NOLINT
    const auto length = static_cast<Py_ssize_t>(data.size());
    const bool view = s->receive == Receive::MEMORYVIEW;
    PyObject* payload = view ? PyMemoryView_FromMemory(const_cast<char*>(bytes), length, PyBUF_READ)
                             : PyBytes_FromStringAndSize(bytes, length);
    if (payload == nullptr) {
      report_callback_error("on_data_cb (making the message)");
      return;
    }
    if (remote != nullptr) {
      const py::object address = s->address_of(*remote);
      call_guarded("on_data_from_cb", s->on_data_from.handle(), address.ptr(), payload);
    } else {
      call_guarded("on_data_cb", s->on_data.handle(), payload);
    }
    if (view) {
      // The data is valid during the callback only: the view is released, so that a later
      // access raises instead of reading a buffer netio3 reuses. A view made from it (an
      // exported buffer) keeps it from being released: that is the application's bug.
      PyObject* released = PyObject_CallMethod(payload, "release", nullptr);
      if (released == nullptr) {
        PyErr_Clear();
        if (PyErr_WarnEx(PyExc_RuntimeWarning,
                         "netio3: a view of received data outlived the data callback; it now "
                         "reads a buffer netio3 reuses (copy what you keep)",
                         1) != 0) {
          report_callback_error("on_data_cb");
        }
      }
      Py_XDECREF(released);
    }
    Py_DECREF(payload);
  });
}

// The Python accept hook's verdict. Its exception refuses the peer with the exception's text
// as the reason (the server logs it); a KeyboardInterrupt or SystemExit is kept for the loop's
// driver as well. Anything but an AcceptDecision or a bool refuses, saying so.
AcceptDecision decide(State* s, const PeerInfo& peer) {
  const py::gil_scoped_acquire gil;
  if (!s->alive) return AcceptDecision::refuse("the backend is being closed");
  const py::object hook = py::reinterpret_borrow<py::object>(s->accept.handle());
  py::object info;
  try {
    info = py::cast(peer);
  } catch (py::error_already_set& e) {
    return AcceptDecision::refuse(std::string{"the accept hook failed: "} + e.what());
  }
  PyObject* result = PyObject_CallFunctionObjArgs(hook.ptr(), info.ptr(), nullptr);
  if (result == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
      report_callback_error("on_accept_cb");
      return AcceptDecision::refuse("the accept hook was interrupted");
    }
    const py::error_already_set error;  // takes the exception
    // "RuntimeError: what it said" (what() would add the traceback).
    std::string text = py::str(error.type().attr("__name__"));
    if (const std::string said = py::str(error.value()); !said.empty()) text += ": " + said;
    return AcceptDecision::refuse("the accept hook failed: " + text);
  }
  const py::object decision = py::reinterpret_steal<py::object>(result);
  if (py::isinstance<AcceptDecision>(decision)) return decision.cast<AcceptDecision>();
  if (PyBool_Check(decision.ptr()) != 0) {
    return decision.ptr() == Py_True ? AcceptDecision::accept() : AcceptDecision::refuse("");
  }
  return AcceptDecision::refuse(std::string{"the accept hook returned a "} +
                                Py_TYPE(decision.ptr())->tp_name +
                                ", neither an AcceptDecision nor a bool");
}

std::span<const std::uint8_t> span_of(const HeldBuffer& held) {
  return {held.data(), held.size()};
}

}  // namespace

// ---- State -----------------------------------------------------------------------------

Connection& State::connection(const EndPointAddress& remote) {
  auto it = connections.find(remote);
  if (it == connections.end()) {
    it = connections.emplace(remote, Connection{}).first;
    it->second.address = to_python(remote);
  }
  return it->second;
}

py::object State::address_of(const EndPointAddress& remote) {
  const auto it = connections.find(remote);
  return it != connections.end() ? it->second.address : to_python(remote);
}

py::object State::end_connection(const EndPointAddress& remote) {
  active_regions.erase(remote);
  const auto it = connections.find(remote);
  if (it == connections.end()) return to_python(remote);
  py::object address = std::move(it->second.address);
  for (PyNetworkBuffer* lent : it->second.lent) lent->invalidate("its connection closed");
  connections.erase(it);  // releases the payloads of its sends
  return address;
}

// ---- PyNetworkBuffer ---------------------------------------------------------------------

PyNetworkBuffer::~PyNetworkBuffer() {
  if (m_buffer == nullptr) return;
  const auto it = m_state->connections.find(m_remote);
  if (it != m_state->connections.end()) it->second.lent.erase(this);
}

NetworkBuffer& PyNetworkBuffer::get() const {
  if (m_buffer == nullptr) {
    throw py::value_error(std::string{"this NetworkBuffer is no longer yours: "} + m_why);
  }
  return *m_buffer;
}

// ---- Backend ---------------------------------------------------------------------------

Backend::Backend(BackendType type, PyConfig config, std::shared_ptr<Loop> loop)
    : m_loop{std::move(loop)}, m_state{std::make_shared<State>()} {
  if (!config.on_data_cb.is_none() && !config.on_data_from_cb.is_none()) {
    throw InvalidConfiguration("set one of on_data_cb and on_data_from_cb");
  }
  if (!config.on_connection_refused_cb.is_none() &&
      !config.on_connection_refused_reason_cb.is_none()) {
    throw InvalidConfiguration(
        "set one of on_connection_refused_cb and on_connection_refused_reason_cb");
  }
  if (!config.on_connection_closed_cb.is_none() &&
      !config.on_connection_closed_reason_cb.is_none()) {
    throw InvalidConfiguration(
        "set one of on_connection_closed_cb and on_connection_closed_reason_cb");
  }
  State* s = m_state.get();  // outlives the C++ backend (close() destroys that first)
  s->receive = config.receive;
  s->on_data = SharedRef{config.on_data_cb};
  s->on_data_from = SharedRef{config.on_data_from_cb};
  s->established = SharedRef{config.on_connection_established_cb};
  s->closed = SharedRef{config.on_connection_closed_cb};
  s->closed_reason = SharedRef{config.on_connection_closed_reason_cb};
  s->refused = SharedRef{config.on_connection_refused_cb};
  s->refused_reason = SharedRef{config.on_connection_refused_reason_cb};
  s->completed = SharedRef{config.on_send_completed_cb};
  s->ready = SharedRef{config.on_ready_to_send_cb};
  s->accept = SharedRef{config.on_accept_cb};
  s->interrupted = SharedRef{config.on_connection_interrupted_cb};
  s->resumed = SharedRef{config.on_connection_resumed_cb};

  NetworkConfig c{.mode = config.mode,
                  .thread_safety = config.thread_safety,
                  .shared_receive_buffers = config.shared_receive_buffers,
                  .shared_send_buffers = config.shared_send_buffers};
  c.limits = config.limits;
  c.partition_key = config.partition_key;
  c.identity = config.identity;
  if (s->on_data_from) {
    c.on_data_from_cb = [s](const EndPointAddress& remote, std::span<const std::uint8_t> data) {
      deliver(s, &remote, data);
    };
  } else if (s->on_data) {
    c.on_data_cb = [s](std::span<const std::uint8_t> data) { deliver(s, nullptr, data); };
  }
  // Always: the Python side keeps per-connection state.
  c.on_connection_established_cb = [s](const EndPointAddress& remote, EndpointCapabilities caps) {
    with_python(s, [&] {
      const py::object address = s->connection(remote).address;
      if (s->established) {
        const py::object capabilities = py::cast(caps);
        call_guarded("on_connection_established_cb", s->established.handle(), address.ptr(),
                     capabilities.ptr());
      }
    });
  };
  // Always with the reason; the Python callable of either variant is called.
  c.on_connection_closed_reason_cb = [s](const EndPointAddress& remote,
                                         const std::vector<std::uint64_t>& keys,
                                         const CloseReason& reason) {
    with_python(s, [&] {
      const py::object address = s->end_connection(remote);
      if (s->closed_reason) {
        const py::list cancelled = py::cast(keys);
        const py::object why = py::cast(reason);
        call_guarded("on_connection_closed_reason_cb", s->closed_reason.handle(), address.ptr(),
                     cancelled.ptr(), why.ptr());
      } else if (s->closed) {
        const py::list cancelled = py::cast(keys);
        call_guarded("on_connection_closed_cb", s->closed.handle(), address.ptr(), cancelled.ptr());
      }
    });
  };
  c.on_connection_refused_reason_cb = [s](const EndPointAddress& remote,
                                          const RefusalReason& reason) {
    with_python(s, [&] {
      const py::object address = s->end_connection(remote);
      if (s->refused_reason) {
        const py::object why = py::cast(reason);
        call_guarded("on_connection_refused_reason_cb", s->refused_reason.handle(), address.ptr(),
                     why.ptr());
      } else if (s->refused) {
        call_guarded("on_connection_refused_cb", s->refused.handle(), address.ptr());
      }
    });
  };
  c.on_send_completed_cb = [s](const EndPointAddress& remote, std::uint64_t key) {
    with_python(s, [&] {
      py::object address;
      if (const auto it = s->connections.find(remote); it != s->connections.end()) {
        it->second.in_flight.erase(key);  // the payload's object is free again
        address = it->second.address;
      } else {
        address = to_python(remote);
      }
      if (s->completed) {
        const py::int_ k{key};
        call_guarded("on_send_completed_cb", s->completed.handle(), address.ptr(), k.ptr());
      }
    });
  };
  if (s->ready) {
    c.on_ready_to_send_cb = [s](const EndPointAddress& remote) {
      with_python(s, [&] {
        const py::object address = s->address_of(remote);
        call_guarded("on_ready_to_send_cb", s->ready.handle(), address.ptr());
      });
    };
  }
  if (s->interrupted) {
    c.on_connection_interrupted_cb = [s](const EndPointAddress& remote, const std::string& reason) {
      with_python(s, [&] {
        const py::object address = s->address_of(remote);
        const py::str why{reason};
        call_guarded("on_connection_interrupted_cb", s->interrupted.handle(), address.ptr(),
                     why.ptr());
      });
    };
  }
  if (s->resumed) {
    c.on_connection_resumed_cb = [s](const EndPointAddress& remote,
                                     std::chrono::milliseconds outage) {
      with_python(s, [&] {
        const py::object address = s->address_of(remote);
        const py::float_ seconds{to_seconds(outage)};
        call_guarded("on_connection_resumed_cb", s->resumed.handle(), address.ptr(), seconds.ptr());
      });
    };
  }
  if (s->accept) {
    c.on_accept_cb = [s](const PeerInfo& peer) { return decide(s, peer); };
  }
  // Creating a transport may take a while (UCX reads its configuration, libfabric asks its
  // providers): other Python threads run meanwhile.
  const py::gil_scoped_release release;
  m_backend = Netio3Backend::create(type, std::move(c), m_loop->get());
}

Backend::~Backend() {
  close();
}

void Backend::close() {
  if (!m_backend) return;
  m_state->alive = false;  // from now on no callback reaches Python
  std::unique_ptr<NetworkBackend> dying = std::move(m_backend);
  if (m_loop->get()->in_loop_thread() || !m_loop->get()->is_running()) {
    dying.reset();  // torn down here and now
  } else {
    // Waits for the loop's thread, which needs the GIL to finish the round it is in.
    const py::gil_scoped_release release;
    dying.reset();
  }
  // The transport holds nothing any more: the buffers lent by Python objects go back.
  for (auto& [remote, connection] : m_state->connections) {
    for (PyNetworkBuffer* lent : connection.lent) lent->invalidate("its backend was closed");
  }
  m_state->connections.clear();
  m_state->active_regions.clear();
  m_state->listener_regions.clear();
}

NetworkBackend& Backend::get() const {
  if (!m_backend) throw py::value_error("the backend was closed");
  return *m_backend;
}

ConnectionParameters Backend::parameters(py::handle params,
                                         std::optional<HeldBuffer>& region) const {
  ConnectionParameters out{};
  if (params.is_none()) return out;
  const auto& p = params.cast<const PyConnectionParameters&>();
  out.recv_params = p.recv_params;
  out.send_buffered_params = p.send_buffered_params;
  out.delivery = p.delivery;
  if (!p.send_zero_copy_params.is_none()) {
    const auto& zc = p.send_zero_copy_params.cast<const PySendZeroCopyParameters&>();
    if (!zc.region.is_none()) {
      region.emplace(zc.region, true);
      out.send_zero_copy_params = {.buf_size = region->size(), .mr_start = region->data()};
    }
  }
  return out;
}

py::object Backend::open_listen_endpoint(py::handle address, py::handle params) {
  const EndPointAddress local = to_address(address);
  std::optional<HeldBuffer> region;
  const auto c = parameters(params, region);
  NetworkBackend& b = get();
  EndPointAddress actual;
  {
    // The first endpoint starts the transport (UCX's context and worker): possibly slow.
    const py::gil_scoped_release release;
    actual = b.open_listen_endpoint(local, c);
  }
  if (region) m_state->listener_regions.push_back(std::move(*region));
  called();
  return to_python(actual);
}

void Backend::open_active_endpoint(py::handle address, py::handle params) {
  const EndPointAddress remote = to_address(address);
  std::optional<HeldBuffer> region;
  const auto c = parameters(params, region);
  NetworkBackend& b = get();
  {
    const py::gil_scoped_release release;
    b.open_active_endpoint(remote, c);
  }
  if (region) m_state->active_regions.insert_or_assign(remote, std::move(*region));
  called();
}

void Backend::close_listen_endpoint(py::handle address) {
  get().close_listen_endpoint(to_address(address));
  called();
}

void Backend::close_active_endpoint(py::handle address) {
  get().close_active_endpoint(to_address(address));
  called();
}

py::object Backend::get_buffer(py::handle address) {
  const EndPointAddress remote = to_address(address);
  NetworkBuffer* buffer = get().get_buffer(remote);
  if (buffer == nullptr) return py::none();
  auto lent = std::make_unique<PyNetworkBuffer>(m_state, remote, buffer);
  m_state->connection(remote).lent.insert(lent.get());
  return py::cast(std::move(lent));
}

NetioStatus Backend::send_buffer(py::handle address, PyNetworkBuffer& buffer) {
  const EndPointAddress remote = to_address(address);
  NetworkBuffer& b = buffer.get();
  const NetioStatus status = get().send_buffer(remote, &b);
  if (status == NetioStatus::OK) {
    if (const auto it = m_state->connections.find(buffer.remote());
        it != m_state->connections.end()) {
      it->second.lent.erase(&buffer);
    }
    buffer.invalidate("it was sent");
    called();
  }
  return status;
}

namespace {

// The payload of a send: one buffer-protocol object, or a list or tuple of them (gathered).
std::vector<HeldBuffer> payload_of(py::handle data) {
  std::vector<HeldBuffer> held;
  if (PyList_Check(data.ptr()) || PyTuple_Check(data.ptr())) {
    const auto items = py::reinterpret_borrow<py::sequence>(data);
    held.reserve(items.size());
    for (const auto item : items) held.emplace_back(item, false);
  } else {
    held.emplace_back(data, false);
  }
  return held;
}

HeldBuffer header_of(py::handle header) {
  if (header.is_none()) return {};
  HeldBuffer held{header, false};
  if (held.size() > MAX_HEADER_SIZE) {
    throw py::value_error("header_data of " + std::to_string(held.size()) + " bytes: at most " +
                          std::to_string(MAX_HEADER_SIZE));
  }
  return held;
}

}  // namespace

NetioStatus Backend::send_data(py::handle address, py::handle data, py::handle header,
                               std::uint64_t key) {
  const EndPointAddress remote = to_address(address);
  const HeldBuffer head = header_of(header);
  std::vector<HeldBuffer> held = payload_of(data);
  if (const auto it = m_state->connections.find(remote);
      it != m_state->connections.end() && it->second.in_flight.contains(key)) {
    throw py::value_error("key " + std::to_string(key) +
                          " is in flight on this connection already: keys must be unique "
                          "until reported");
  }
  NetioStatus status{};
  if (held.size() == 1) {
    status = get().send_data(remote, std::span<std::uint8_t>{held[0].data(), held[0].size()},
                             span_of(head), key);
  } else {
    std::vector<iovec> iov;
    iov.reserve(held.size());
    for (const auto& h : held) iov.push_back(iovec{h.data(), h.size()});
    status = get().send_data(remote, std::span<const iovec>{iov}, span_of(head), key);
  }
  if (status == NetioStatus::OK) {
    // Held until the key is reported: the transport reads the objects' memory until then.
    m_state->connection(remote).in_flight.emplace(key, std::move(held));
    called();
  }
  return status;
}

NetioStatus Backend::send_data_copy(py::handle address, py::handle data, py::handle header,
                                    std::uint64_t key) {
  const EndPointAddress remote = to_address(address);
  const HeldBuffer head = header_of(header);
  const std::vector<HeldBuffer> held = payload_of(data);
  NetioStatus status{};
  if (held.size() == 1) {
    status = get().send_data_copy(remote, span_of(held[0]), span_of(head), key);
  } else {
    std::vector<iovec> iov;
    iov.reserve(held.size());
    for (const auto& h : held) iov.push_back(iovec{h.data(), h.size()});
    status = get().send_data_copy(remote, std::span<const iovec>{iov}, span_of(head), key);
  }
  if (status == NetioStatus::OK) called();
  return status;
}

ConnectionStatistics Backend::statistics(py::handle address) {
  const EndPointAddress remote = to_address(address);
  if (m_loop->get()->in_loop_thread()) return get().statistics(remote);
  NetworkBackend& b = get();
  const py::gil_scoped_release release;  // UNSAFE: it runs on the loop's thread
  return b.statistics(remote);
}

std::vector<ConnectionStatistics> Backend::connection_statistics() {
  if (m_loop->get()->in_loop_thread()) return get().connection_statistics();
  NetworkBackend& b = get();
  const py::gil_scoped_release release;
  return b.connection_statistics();
}

BackendStatistics Backend::backend_statistics() {
  if (m_loop->get()->in_loop_thread()) return get().backend_statistics();
  NetworkBackend& b = get();
  const py::gil_scoped_release release;
  return b.backend_statistics();
}

BackendType Backend::type() const {
  return get().type();
}

// ---- the Python classes ------------------------------------------------------------------

void bind_backend(py::module_& m) {
  py::class_<RecvParameters>(m, "RecvParameters", "Receive buffers of a connection.")
      .def(py::init([](std::size_t buf_size, std::size_t num_buf, bool shared) {
             return RecvParameters{buf_size, num_buf, shared};
           }),
           py::arg("buf_size") = 0, py::arg("num_buf") = 0,
           py::arg("use_shared_receive_buffers") = false)
      .def_readwrite("buf_size", &RecvParameters::buf_size)
      .def_readwrite("num_buf", &RecvParameters::num_buf)
      .def_readwrite("use_shared_receive_buffers", &RecvParameters::use_shared_receive_buffers);
  py::class_<SendBufferedParameters>(m, "SendBufferedParameters",
                                     "Send buffers of a connection (get_buffer).")
      .def(py::init([](std::size_t buf_size, std::size_t num_buf) {
             return SendBufferedParameters{buf_size, num_buf};
           }),
           py::arg("buf_size") = 0, py::arg("num_buf") = 0)
      .def_readwrite("buf_size", &SendBufferedParameters::buf_size)
      .def_readwrite("num_buf", &SendBufferedParameters::num_buf);
  py::class_<PySendZeroCopyParameters>(m, "SendZeroCopyParameters", R"doc(
The memory a connection sends from without copying: `region`, a writable C-contiguous
buffer (bytearray, numpy array, mmap). libfabric and UCX register it and send only from
inside it; netio3 holds it until the connection ends.)doc")
      .def(py::init([](py::object region) { return PySendZeroCopyParameters{std::move(region)}; }),
           py::arg("region") = py::none())
      .def_readwrite("region", &PySendZeroCopyParameters::region);
  using Session = DeliveryParameters::Session;
  py::class_<Session>(m, "SessionParameters", R"doc(
Sessions (docs/sessions.md, asyncmsg): `enabled`, a connection that rides out a cut - it is
interrupted and resumed (every message delivered once, in order) rather than closed; the
connecting side reconnects after `first_delay` seconds, doubling up to `max_delay`, with
jitter, and gives up after `give_up` seconds of outage.)doc")
      .def(py::init([](bool enabled, const py::object& first_delay, const py::object& max_delay,
                       const py::object& give_up) {
             Session session{.enabled = enabled};
             if (!first_delay.is_none()) session.first_delay = to_milliseconds(first_delay);
             if (!max_delay.is_none()) session.max_delay = to_milliseconds(max_delay);
             if (!give_up.is_none()) session.give_up = to_milliseconds(give_up);
             return session;
           }),
           py::arg("enabled") = false, py::arg("first_delay") = py::none(),
           py::arg("max_delay") = py::none(), py::arg("give_up") = py::none())
      .def_readwrite("enabled", &Session::enabled)
      .def_property(
          "first_delay", [](const Session& p) { return to_seconds(p.first_delay); },
          [](Session& p, py::handle v) { p.first_delay = to_milliseconds(v); })
      .def_property(
          "max_delay", [](const Session& p) { return to_seconds(p.max_delay); },
          [](Session& p, py::handle v) { p.max_delay = to_milliseconds(v); })
      .def_property(
          "give_up", [](const Session& p) { return to_seconds(p.give_up); },
          [](Session& p, py::handle v) { p.give_up = to_milliseconds(v); });
  py::class_<DeliveryParameters>(m, "DeliveryParameters", R"doc(
What a send's completion means on a connection. `acknowledged`: it completes once the peer's
application was handed the message (else: once it left this process). `replay_window`: bytes
of acknowledged sends not yet acknowledged beyond which a send is refused (NO_RESOURCES).
`session` (SessionParameters, asyncmsg): resume the connection after a cut.)doc")
      .def(py::init([](bool acknowledged, std::size_t replay_window, Session session) {
             DeliveryParameters delivery{acknowledged, replay_window};
             delivery.session = session;
             return delivery;
           }),
           py::arg("acknowledged") = false,
           py::arg("replay_window") = DeliveryParameters{}.replay_window,
           py::arg("session") = Session{})
      .def_readwrite("acknowledged", &DeliveryParameters::acknowledged)
      .def_readwrite("replay_window", &DeliveryParameters::replay_window)
      .def_readwrite("session", &DeliveryParameters::session);
  py::class_<PyConnectionParameters>(m, "ConnectionParameters",
                                     "What a connection (or a listener's connections) can do.")
      .def(py::init([](RecvParameters recv, SendBufferedParameters buffered, py::object zero_copy,
                       DeliveryParameters delivery) {
             return PyConnectionParameters{recv, buffered, std::move(zero_copy), delivery};
           }),
           py::arg("recv_params") = RecvParameters{},
           py::arg("send_buffered_params") = SendBufferedParameters{},
           py::arg("send_zero_copy_params") = py::none(),
           py::arg("delivery") = DeliveryParameters{})
      .def_readwrite("recv_params", &PyConnectionParameters::recv_params)
      .def_readwrite("send_buffered_params", &PyConnectionParameters::send_buffered_params)
      .def_readwrite("send_zero_copy_params", &PyConnectionParameters::send_zero_copy_params)
      .def_readwrite("delivery", &PyConnectionParameters::delivery);

  py::class_<SharedReceiveBuffers>(m, "SharedReceiveBuffers",
                                   "One receive pool for every connection of the backend.")
      .def(py::init([](bool use, std::size_t buf_size, std::size_t num_buf) {
             return SharedReceiveBuffers{use, buf_size, num_buf};
           }),
           py::arg("use_shared_receive_buffers") = true, py::arg("buf_size") = 0,
           py::arg("num_buf") = 0)
      .def_readwrite("use_shared_receive_buffers",
                     &SharedReceiveBuffers::use_shared_receive_buffers)
      .def_readwrite("buf_size", &SharedReceiveBuffers::buf_size)
      .def_readwrite("num_buf", &SharedReceiveBuffers::num_buf);
  py::class_<SharedSendBuffers>(m, "SharedSendBuffers",
                                "One send pool for every connection of the backend.")
      .def(py::init([](bool use, std::size_t buf_size, std::size_t num_buf) {
             return SharedSendBuffers{use, buf_size, num_buf};
           }),
           py::arg("use_shared_send_buffers") = true, py::arg("buf_size") = 0,
           py::arg("num_buf") = 0)
      .def_readwrite("use_shared_send_buffers", &SharedSendBuffers::use_shared_send_buffers)
      .def_readwrite("buf_size", &SharedSendBuffers::buf_size)
      .def_readwrite("num_buf", &SharedSendBuffers::num_buf);
  py::class_<NetworkLimits>(m, "NetworkLimits",
                            "Bounds that protect a process (C++ NetworkLimits). Every member "
                            "may be given as a keyword: NetworkLimits(connect_timeout=2).")
      .def(py::init([](const py::object& max_message_size, const py::object& max_unsent_bytes,
                       const py::object& max_receive_memory, const py::object& connect_timeout,
                       const py::object& close_timeout, const py::object& peer_timeout,
                       const py::object& max_interrupted_sessions) {
             NetworkLimits l{};
             if (!max_message_size.is_none())
               l.max_message_size = max_message_size.cast<std::size_t>();
             if (!max_unsent_bytes.is_none())
               l.max_unsent_bytes = max_unsent_bytes.cast<std::size_t>();
             if (!max_receive_memory.is_none()) {
               l.max_receive_memory = max_receive_memory.cast<std::size_t>();
             }
             if (!connect_timeout.is_none()) l.connect_timeout = to_milliseconds(connect_timeout);
             if (!close_timeout.is_none()) l.close_timeout = to_milliseconds(close_timeout);
             if (!peer_timeout.is_none()) l.peer_timeout = to_milliseconds(peer_timeout);
             if (!max_interrupted_sessions.is_none()) {
               l.max_interrupted_sessions = max_interrupted_sessions.cast<std::size_t>();
             }
             return l;
           }),
           py::kw_only(), py::arg("max_message_size") = py::none(),
           py::arg("max_unsent_bytes") = py::none(), py::arg("max_receive_memory") = py::none(),
           py::arg("connect_timeout") = py::none(), py::arg("close_timeout") = py::none(),
           py::arg("peer_timeout") = py::none(), py::arg("max_interrupted_sessions") = py::none())
      .def_readwrite("max_message_size", &NetworkLimits::max_message_size)
      .def_readwrite("max_unsent_bytes", &NetworkLimits::max_unsent_bytes)
      .def_readwrite("max_receive_memory", &NetworkLimits::max_receive_memory)
      .def_readwrite("max_interrupted_sessions", &NetworkLimits::max_interrupted_sessions,
                     "Interrupted sessions a listening side keeps (docs/sessions.md).")
      .def_property(
          "connect_timeout", [](const NetworkLimits& l) { return to_seconds(l.connect_timeout); },
          [](NetworkLimits& l, py::handle v) { l.connect_timeout = to_milliseconds(v); },
          "Seconds (or a timedelta) the connection set-up may take.")
      .def_property(
          "close_timeout", [](const NetworkLimits& l) { return to_seconds(l.close_timeout); },
          [](NetworkLimits& l, py::handle v) { l.close_timeout = to_milliseconds(v); },
          "Seconds a close waits for UCX to flush.")
      .def_property(
          "peer_timeout", [](const NetworkLimits& l) { return to_seconds(l.peer_timeout); },
          [](NetworkLimits& l, py::handle v) { l.peer_timeout = to_milliseconds(v); },
          "Seconds of silence after which a peer is taken for gone.");

  py::class_<PyConfig>(m, "NetworkConfig", R"doc(
Everything a backend is created with (C++ NetworkConfig), with Python callables as the
callbacks. Every callback is optional and runs on the loop's thread:
on_data_cb(data), on_data_from_cb(remote, data), on_connection_established_cb(remote,
capabilities), on_connection_closed_cb(remote, cancelled_keys),
on_connection_closed_reason_cb(remote, cancelled_keys, reason) (instead of
on_connection_closed_cb: a CloseReason with the CloseCause and the message),
on_connection_refused_cb(remote), on_connection_refused_reason_cb(remote, reason),
on_send_completed_cb(remote, key), on_ready_to_send_cb(remote),
on_connection_interrupted_cb(remote, reason) and on_connection_resumed_cb(remote,
outage_seconds) (sessions, docs/sessions.md). `receive` is
Receive.BYTES (data is a bytes copy) or Receive.MEMORYVIEW (a read-only view valid during the
callback only, released after it). partition_key and identity are admission's
(docs/admission.md): a key both sides prove, at least 16 bytes, and the name this side
presents; on_accept_cb(peer) decides about each peer that comes in through a listening
endpoint (a PeerInfo; return AcceptDecision.accept(), AcceptDecision.refuse("why"), or a
bool; an exception refuses, with its text as the reason). A refused client gets
RefusalCause.NOT_ADMITTED with the server's reason.)doc")
      .def(py::init([](NetworkMode mode, ThreadSafetyModel thread_safety,
                       SharedReceiveBuffers shared_receive_buffers,
                       SharedSendBuffers shared_send_buffers, py::object on_data_cb,
                       py::object on_connection_established_cb, py::object on_connection_closed_cb,
                       py::object on_connection_refused_cb, py::object on_send_completed_cb,
                       NetworkLimits limits, py::object on_ready_to_send_cb,
                       py::object on_data_from_cb, py::object on_connection_refused_reason_cb,
                       Receive receive, std::string partition_key, std::string identity,
                       py::object on_accept_cb, py::object on_connection_closed_reason_cb,
                       py::object on_connection_interrupted_cb,
                       py::object on_connection_resumed_cb) {
             return PyConfig{mode,
                             thread_safety,
                             shared_receive_buffers,
                             shared_send_buffers,
                             std::move(on_data_cb),
                             std::move(on_connection_established_cb),
                             std::move(on_connection_closed_cb),
                             std::move(on_connection_refused_cb),
                             std::move(on_send_completed_cb),
                             limits,
                             std::move(on_ready_to_send_cb),
                             std::move(on_data_from_cb),
                             std::move(on_connection_refused_reason_cb),
                             receive,
                             std::move(partition_key),
                             std::move(identity),
                             std::move(on_accept_cb),
                             std::move(on_connection_closed_reason_cb),
                             std::move(on_connection_interrupted_cb),
                             std::move(on_connection_resumed_cb)};
           }),
           py::kw_only(), py::arg("mode") = NetworkMode::TCP,
           py::arg("thread_safety") = ThreadSafetyModel::SAFE,
           py::arg("shared_receive_buffers") = SharedReceiveBuffers{},
           py::arg("shared_send_buffers") = SharedSendBuffers{}, py::arg("on_data_cb") = py::none(),
           py::arg("on_connection_established_cb") = py::none(),
           py::arg("on_connection_closed_cb") = py::none(),
           py::arg("on_connection_refused_cb") = py::none(),
           py::arg("on_send_completed_cb") = py::none(), py::arg("limits") = NetworkLimits{},
           py::arg("on_ready_to_send_cb") = py::none(), py::arg("on_data_from_cb") = py::none(),
           py::arg("on_connection_refused_reason_cb") = py::none(),
           py::arg("receive") = Receive::BYTES, py::arg("partition_key") = std::string{},
           py::arg("identity") = std::string{}, py::arg("on_accept_cb") = py::none(),
           py::arg("on_connection_closed_reason_cb") = py::none(),
           py::arg("on_connection_interrupted_cb") = py::none(),
           py::arg("on_connection_resumed_cb") = py::none())
      .def_readwrite("mode", &PyConfig::mode)
      .def_readwrite("thread_safety", &PyConfig::thread_safety)
      .def_readwrite("shared_receive_buffers", &PyConfig::shared_receive_buffers)
      .def_readwrite("shared_send_buffers", &PyConfig::shared_send_buffers)
      .def_readwrite("on_data_cb", &PyConfig::on_data_cb)
      .def_readwrite("on_connection_established_cb", &PyConfig::on_connection_established_cb)
      .def_readwrite("on_connection_closed_cb", &PyConfig::on_connection_closed_cb)
      .def_readwrite("on_connection_refused_cb", &PyConfig::on_connection_refused_cb)
      .def_readwrite("on_send_completed_cb", &PyConfig::on_send_completed_cb)
      .def_readwrite("limits", &PyConfig::limits)
      .def_readwrite("on_ready_to_send_cb", &PyConfig::on_ready_to_send_cb)
      .def_readwrite("on_data_from_cb", &PyConfig::on_data_from_cb)
      .def_readwrite("on_connection_refused_reason_cb", &PyConfig::on_connection_refused_reason_cb)
      .def_readwrite("receive", &PyConfig::receive)
      .def_readwrite("partition_key", &PyConfig::partition_key)
      .def_readwrite("identity", &PyConfig::identity)
      .def_readwrite("on_accept_cb", &PyConfig::on_accept_cb)
      .def_readwrite("on_connection_closed_reason_cb", &PyConfig::on_connection_closed_reason_cb)
      .def_readwrite("on_connection_interrupted_cb", &PyConfig::on_connection_interrupted_cb)
      .def_readwrite("on_connection_resumed_cb", &PyConfig::on_connection_resumed_cb);

  py::class_<PyNetworkBuffer>(m, "NetworkBuffer", R"doc(
A send buffer lent by NetworkBackend.get_buffer: write into it, then send_buffer(). It is
yours until send_buffer returned OK or its connection closed; after that every use raises
ValueError. `view()` is a writable memoryview of the whole buffer for filling it in place
(numpy.frombuffer works on it); set `size` to the bytes written that way. Do not keep such a
view past send_buffer.)doc")
      .def(
          "write",
          [](PyNetworkBuffer& self, py::handle data) {
            NetworkBuffer& b = self.get();
            const HeldBuffer held{data, false};
            b.write(span_of(held));
          },
          py::arg("data"),
          "Appends the bytes of a buffer-protocol object; BufferOverflow if they do not fit.")
      .def(
          "view",
          [](PyNetworkBuffer& self) {
            NetworkBuffer& b = self.get();
            return py::reinterpret_steal<py::object>(
                PyMemoryView_FromMemory(reinterpret_cast<char*>(b.data()),  // NOLINT
                                        static_cast<Py_ssize_t>(b.capacity()), PyBUF_WRITE));
          },
          "A writable memoryview of the whole buffer (capacity bytes).")
      .def_property(
          "size", [](const PyNetworkBuffer& self) { return self.get().size(); },
          [](PyNetworkBuffer& self, std::size_t size) { self.get().resize(size); },
          "Bytes written so far: what send_buffer sends. Settable after filling view().")
      .def_property_readonly("capacity",
                             [](const PyNetworkBuffer& self) { return self.get().capacity(); })
      .def_property_readonly(
          "id", [](const PyNetworkBuffer& self) { return self.get().id(); },
          "The key on_send_completed_cb reports for this buffer.")
      .def(
          "clear", [](PyNetworkBuffer& self) { self.get().clear(); }, "Empties the buffer.");

  py::class_<Backend, std::shared_ptr<Backend>>(m, "NetworkBackend", R"doc(
A backend (one transport) on an EpollEventLoop: create it with netio3.create(). The methods
are those of the C++ NetworkBackend; addresses are (IP, port) pairs (EndPointAddress).
Zero-copy sends hold the payload objects until their key is reported (a bytearray cannot be
resized meanwhile). close() (or the last reference going) closes everything without
callbacks.)doc")
      .def("close", &Backend::close,
           "Closes every endpoint without callbacks; sends in flight are dropped.")
      .def("open_listen_endpoint", &Backend::open_listen_endpoint, py::arg("address"),
           py::arg("params") = py::none(),
           "Listens; returns the address listened on (with the port the OS chose for 0).")
      .def("open_active_endpoint", &Backend::open_active_endpoint, py::arg("address"),
           py::arg("params") = py::none(),
           "Starts connecting; on_connection_established_cb or a refusal callback follows.")
      .def("close_listen_endpoint", &Backend::close_listen_endpoint, py::arg("address"))
      .def("close_active_endpoint", &Backend::close_active_endpoint, py::arg("address"))
      .def("get_buffer", &Backend::get_buffer, py::arg("address"),
           "A free send buffer of the connection, or None when all are in use.")
      .def("send_buffer", &Backend::send_buffer, py::arg("address"), py::arg("buffer"))
      .def("send_data", &Backend::send_data, py::arg("address"), py::arg("data"),
           py::arg("header_data") = py::none(), py::arg("key") = 0, R"doc(
Zero-copy: `data` (a C-contiguous buffer, or a list of them, gathered) is held and read in
place until `key` is reported; up to 16 bytes of `header_data` are copied. A non-contiguous
array or a longer header raises before anything is sent.)doc")
      .def("send_data_copy", &Backend::send_data_copy, py::arg("address"), py::arg("data"),
           py::arg("header_data") = py::none(), py::arg("key") = 0,
           "Immediate: header and data are copied before the call returns.")
      .def("statistics", &Backend::statistics, py::arg("address"))
      .def("connection_statistics", &Backend::connection_statistics)
      .def("backend_statistics", &Backend::backend_statistics)
      .def_property_readonly("type", &Backend::type)
      .def_property_readonly("loop", &Backend::loop);

  m.def(
      "create",
      [](py::object type, const PyConfig& config, std::shared_ptr<Loop> loop) {
        BackendType t{};
        if (py::isinstance<py::str>(type)) {
          const auto parsed = parse_backend_type(type.cast<std::string>());
          if (!parsed) {
            throw InvalidConfiguration("unknown backend '" + type.cast<std::string>() +
                                       "' (asyncmsg, libfabric, ucx)");
          }
          t = *parsed;
        } else {
          t = type.cast<BackendType>();
        }
        if (!loop) throw py::value_error("create: the event loop is None");
        return std::make_shared<Backend>(t, config, std::move(loop));
      },
      py::arg("type"), py::arg("config"), py::arg("loop"),
      "Netio3Backend::create: a backend of `type` (BackendType or its name) on `loop`.");
}

}  // namespace netio3::python
