// netio3._netio3: the C++ API for Python, one to one (docs/python.md, layer 1). The asyncio
// layer (netio3.aio) is written in Python over it.

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <system_error>

#include <netio3/netio3.hpp>
#include <netio3/version.hpp>

#include "backend.hpp"
#include "loop.hpp"
#include "support.hpp"

namespace netio3::python {
namespace {

void bind_types(py::module_& m) {
  py::enum_<BackendType>(m, "BackendType", "The transport of a backend.")
      .value("ASYNCMSG", BackendType::ASYNCMSG)
      .value("LIBFABRIC", BackendType::LIBFABRIC)
      .value("UCX", BackendType::UCX);
  py::enum_<NetworkMode>(m, "NetworkMode", "RDMA or TCP network.")
      .value("RDMA", NetworkMode::RDMA)
      .value("TCP", NetworkMode::TCP);
  py::enum_<ThreadSafetyModel>(m, "ThreadSafetyModel", "Who may call a backend.")
      .value("SAFE", ThreadSafetyModel::SAFE)
      .value("UNSAFE", ThreadSafetyModel::UNSAFE);
  py::enum_<NetioStatus>(m, "NetioStatus", "The result of a send.")
      .value("OK", NetioStatus::OK)
      .value("NO_RESOURCES", NetioStatus::NO_RESOURCES)
      .value("FAILED", NetioStatus::FAILED);
  py::enum_<RefusalCause>(m, "RefusalCause", "Why a connection could not be set up.")
      .value("UNREACHABLE", RefusalCause::UNREACHABLE)
      .value("TIMED_OUT", RefusalCause::TIMED_OUT)
      .value("REJECTED", RefusalCause::REJECTED)
      .value("SETUP_FAILED", RefusalCause::SETUP_FAILED)
      .value("NOT_ADMITTED", RefusalCause::NOT_ADMITTED);
  py::enum_<Receive>(m, "Receive", "How received data reaches on_data_cb.")
      .value("BYTES", Receive::BYTES, "a bytes copy")
      .value("MEMORYVIEW", Receive::MEMORYVIEW,
             "a read-only memoryview, valid during the callback only");

  py::class_<EndpointCapabilities>(m, "EndpointCapabilities",
                                   "What a connection can do, as seen from the local side.")
      .def(py::init<>())
      .def_readwrite("send_buffered", &EndpointCapabilities::send_buffered)
      .def_readwrite("send_copy", &EndpointCapabilities::send_copy)
      .def_readwrite("send_zero_copy", &EndpointCapabilities::send_zero_copy)
      .def_readwrite("receive", &EndpointCapabilities::receive)
      .def("__eq__",
           [](const EndpointCapabilities& a, const EndpointCapabilities& b) { return a == b; })
      .def("__repr__", [](const EndpointCapabilities& c) {
        return "EndpointCapabilities(send_buffered=" +
               std::string{c.send_buffered ? "True" : "False"} +
               ", send_copy=" + (c.send_copy ? "True" : "False") +
               ", send_zero_copy=" + (c.send_zero_copy ? "True" : "False") +
               ", receive=" + (c.receive ? "True" : "False") + ")";
      });
  py::enum_<CloseCause>(m, "CloseCause", "Why an established connection ended.")
      .value("LOCAL", CloseCause::LOCAL)
      .value("PEER_CLOSED", CloseCause::PEER_CLOSED)
      .value("PEER_LOST", CloseCause::PEER_LOST)
      .value("TIMED_OUT", CloseCause::TIMED_OUT)
      .value("PROTOCOL_ERROR", CloseCause::PROTOCOL_ERROR);
  py::class_<CloseReason>(m, "CloseReason", "Why a connection ended.")
      .def_readonly("cause", &CloseReason::cause)
      .def_readonly("message", &CloseReason::message)
      .def("__repr__", [](const CloseReason& r) {
        return "CloseReason(" + std::string{to_string(r.cause)} + ": " + r.message + ")";
      });
  py::enum_<SendFailureCause>(m, "SendFailureCause", "Why a send returned FAILED.")
      .value("CLOSING", SendFailureCause::CLOSING)
      .value("TOO_LARGE", SendFailureCause::TOO_LARGE)
      .value("INVALID", SendFailureCause::INVALID)
      .value("TRANSPORT", SendFailureCause::TRANSPORT);
  py::class_<SendFailure>(m, "SendFailure", "Why a send returned FAILED.")
      .def_readonly("cause", &SendFailure::cause)
      .def_readonly("message", &SendFailure::message)
      .def("__repr__", [](const SendFailure& r) {
        return "SendFailure(" + std::string{to_string(r.cause)} + ": " + r.message + ")";
      });
  m.def(
      "last_send_failure", [] { return last_send_failure(); },
      "Why the last send on this thread that returned NetioStatus.FAILED failed (a copy).");
  py::class_<RefusalReason>(m, "RefusalReason", "Why a connection was refused.")
      .def_readonly("cause", &RefusalReason::cause)
      .def_readonly("message", &RefusalReason::message)
      .def("__repr__", [](const RefusalReason& r) {
        return "RefusalReason(" + std::string{to_string(r.cause)} + ": " + r.message + ")";
      });

  py::class_<PeerInfo>(m, "PeerInfo",
                       "Who asks to be admitted through a listening endpoint (on_accept_cb).")
      .def_property_readonly(
          "remote", [](const PeerInfo& p) { return to_python(p.remote); },
          "The peer's source address (an EndPointAddress).")
      .def_property_readonly(
          "listener", [](const PeerInfo& p) { return to_python(p.listener); },
          "The listening endpoint it came in through.")
      .def_property_readonly(
          "identity",
          [](const PeerInfo& p) {
            // Any bytes: what cannot be decoded as UTF-8 is kept as surrogates (round-trips).
            return py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(
                p.identity.data(), static_cast<Py_ssize_t>(p.identity.size()), "surrogateescape"));
          },
          "The identity the peer presented (proven with the key), or empty.")
      .def_readonly("key_proven", &PeerInfo::key_proven,
                    "Whether the peer proved it holds this side's partition_key.")
      .def("__repr__", [](const py::object& self) {
        // Through the properties: the identity as its (surrogate-escaped) str's repr.
        return py::str("PeerInfo(remote={!r}, listener={!r}, identity={!r}, key_proven={!r})")
            .format(self.attr("remote"), self.attr("listener"), self.attr("identity"),
                    self.attr("key_proven"));
      });
  py::class_<AcceptDecision>(m, "AcceptDecision", "What on_accept_cb decides for one peer.")
      .def_static("accept", &AcceptDecision::accept, "Admit the peer.")
      .def_static("refuse", &AcceptDecision::refuse, py::arg("reason") = std::string{},
                  "Refuse the peer; the client reports the reason (NOT_ADMITTED).")
      .def_readonly("admit", &AcceptDecision::admit)
      .def_readonly("reason", &AcceptDecision::reason)
      .def("__repr__", [](const AcceptDecision& d) {
        return d.admit ? std::string{"AcceptDecision.accept()"}
                       : "AcceptDecision.refuse('" + d.reason + "')";
      });

  py::class_<ConnectionStatistics>(m, "ConnectionStatistics",
                                   "A snapshot of one connection's counters.")
      .def_property_readonly("remote",
                             [](const ConnectionStatistics& s) { return to_python(s.remote); })
      .def_readonly("open", &ConnectionStatistics::open)
      .def_readonly("age", &ConnectionStatistics::age)
      .def_readonly("sends_accepted", &ConnectionStatistics::sends_accepted)
      .def_readonly("sends_completed", &ConnectionStatistics::sends_completed)
      .def_readonly("sends_cancelled", &ConnectionStatistics::sends_cancelled)
      .def_readonly("sends_no_resources", &ConnectionStatistics::sends_no_resources)
      .def_readonly("sends_failed", &ConnectionStatistics::sends_failed)
      .def_readonly("bytes_sent", &ConnectionStatistics::bytes_sent)
      .def_readonly("keys_in_flight", &ConnectionStatistics::keys_in_flight)
      .def_readonly("bytes_queued", &ConnectionStatistics::bytes_queued)
      .def_readonly("send_buffers_high_water", &ConnectionStatistics::send_buffers_high_water)
      .def_readonly("messages_received", &ConnectionStatistics::messages_received)
      .def_readonly("bytes_received", &ConnectionStatistics::bytes_received);
  py::class_<BackendStatistics>(m, "BackendStatistics", "A snapshot of a backend's counters.")
      .def_readonly("connections_open", &BackendStatistics::connections_open)
      .def_readonly("connections_set_up", &BackendStatistics::connections_set_up)
      .def_readonly("connections_closed", &BackendStatistics::connections_closed)
      .def_readonly("sends_accepted", &BackendStatistics::sends_accepted)
      .def_readonly("sends_completed", &BackendStatistics::sends_completed)
      .def_readonly("sends_cancelled", &BackendStatistics::sends_cancelled)
      .def_readonly("sends_no_resources", &BackendStatistics::sends_no_resources)
      .def_readonly("sends_failed", &BackendStatistics::sends_failed)
      .def_readonly("bytes_sent", &BackendStatistics::bytes_sent)
      .def_readonly("keys_in_flight", &BackendStatistics::keys_in_flight)
      .def_readonly("bytes_queued", &BackendStatistics::bytes_queued)
      .def_readonly("messages_received", &BackendStatistics::messages_received)
      .def_readonly("bytes_received", &BackendStatistics::bytes_received);
}

// Every C++ exception as a Python class of the same name under NetioException (a
// RuntimeError, as the C++ one is a std::runtime_error).
void bind_exceptions(py::module_& m) {
  const auto base = py::register_exception<NetioException>(m, "NetioException", PyExc_RuntimeError);
  py::register_exception<InvalidEndpointAddress>(m, "InvalidEndpointAddress", base);
  py::register_exception<ListenEndpointAlreadyExists>(m, "ListenEndpointAlreadyExists", base);
  py::register_exception<FailedOpenListenEndpoint>(m, "FailedOpenListenEndpoint", base);
  py::register_exception<InvalidConnectionParameters>(m, "InvalidConnectionParameters", base);
  py::register_exception<ActiveEndpointAlreadyExists>(m, "ActiveEndpointAlreadyExists", base);
  py::register_exception<FailedOpenActiveEndpoint>(m, "FailedOpenActiveEndpoint", base);
  py::register_exception<UnknownActiveEndpoint>(m, "UnknownActiveEndpoint", base);
  py::register_exception<UnknownListenEndpoint>(m, "UnknownListenEndpoint", base);
  py::register_exception<NoBuffersAllocated>(m, "NoBuffersAllocated", base);
  py::register_exception<NotSupported>(m, "NotSupported", base);
  py::register_exception<FailedCloseActiveEndpoint>(m, "FailedCloseActiveEndpoint", base);
  py::register_exception<FailedCloseListenEndpoint>(m, "FailedCloseListenEndpoint", base);
  py::register_exception<BufferOverflow>(m, "BufferOverflow", base);
  py::register_exception<InvalidConfiguration>(m, "InvalidConfiguration", base);
  // A system call that failed (std::system_error: eventfd, timerfd, epoll with no file
  // descriptor left, ...) as Python's OSError with its errno, so `except OSError` and
  // `e.errno == errno.EMFILE` work; translators registered last are tried first.
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) {
        std::rethrow_exception(thrown);
      }
    } catch (const std::system_error& e) {
      if (e.code().category() != std::system_category() &&
          e.code().category() != std::generic_category()) {
        throw;
      }
      const py::object error =
          py::reinterpret_borrow<py::object>(PyExc_OSError)(e.code().value(), e.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });
}

}  // namespace
}  // namespace netio3::python

PYBIND11_MODULE(_netio3, m) {
  using namespace netio3::python;
  m.doc() = "netio3's C++ API for Python (layer 1); see netio3.aio for the asyncio layer.";
  m.attr("EndPointAddress") = address_type();
  m.attr("MAX_HEADER_SIZE") = netio3::MAX_HEADER_SIZE;
  m.attr("__version__") = NETIO3_VERSION_STRING;
  m.def(
      "version", [] { return std::string{netio3::version_string()}; },
      "The library's version at run time.");
  m.def(
      "available", [] { return netio3::Netio3Backend::available(); },
      "The backends compiled into this build.");
  bind_exceptions(m);
  bind_types(m);
  bind_loop(m);
  bind_backend(m);
}
