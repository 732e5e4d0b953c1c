#include "support.hpp"

#include <string>

namespace netio3::python {

py::object& address_type() {
  // Leaked on purpose: destroyed at exit it would need the GIL after the interpreter is gone.
  static auto* type =
      new py::object{py::module_::import("collections")
                         .attr("namedtuple")("EndPointAddress", py::make_tuple("address", "port"))};
  return *type;
}

EndPointAddress to_address(py::handle object) {
  if (PyTuple_Check(object.ptr()) && PyTuple_GET_SIZE(object.ptr()) == 2) {
    PyObject* address = PyTuple_GET_ITEM(object.ptr(), 0);
    PyObject* port = PyTuple_GET_ITEM(object.ptr(), 1);
    if (PyUnicode_Check(address) && PyLong_Check(port)) {
      Py_ssize_t length = 0;
      const char* text = PyUnicode_AsUTF8AndSize(address, &length);
      if (text == nullptr) throw py::error_already_set();
      const long value = PyLong_AsLong(port);
      if (value == -1 && PyErr_Occurred() != nullptr) throw py::error_already_set();
      if (value < 0 || value > 65535) {
        throw py::value_error("port " + std::to_string(value) + " is not in [0, 65535]");
      }
      return EndPointAddress{std::string{text, static_cast<std::size_t>(length)},
                             static_cast<std::uint16_t>(value)};
    }
  }
  if (py::hasattr(object, "address") && py::hasattr(object, "port")) {
    return to_address(py::make_tuple(object.attr("address"), object.attr("port")));
  }
  if (PyList_Check(object.ptr()) && PyList_GET_SIZE(object.ptr()) == 2) {
    return to_address(py::tuple{py::reinterpret_borrow<py::list>(object)});
  }
  throw py::type_error("an address is an (IP address, port) pair, e.g. ('127.0.0.1', 5000)");
}

py::object to_python(const EndPointAddress& address) {
  return address_type()(address.address, address.port);
}

std::chrono::milliseconds to_milliseconds(py::handle seconds) {
  double value = 0;
  if (py::isinstance<py::float_>(seconds) || py::isinstance<py::int_>(seconds)) {
    value = seconds.cast<double>();
  } else if (py::hasattr(seconds, "total_seconds")) {
    value = seconds.attr("total_seconds")().cast<double>();
  } else {
    throw py::type_error("a duration is a number of seconds or a datetime.timedelta");
  }
  if (!(value >= 0) || value > 1e9) throw py::value_error("a duration must be >= 0 seconds");
  return std::chrono::milliseconds{static_cast<std::int64_t>(value * 1000.0 + 0.5)};
}

double to_seconds(std::chrono::milliseconds duration) {
  return static_cast<double>(duration.count()) / 1000.0;
}

SharedRef::SharedRef(py::object object)
    : m_ref{object.release().ptr(), [](PyObject* p) {
              if (p == nullptr) return;
              if (PyGILState_Check() != 0) {
                Py_DECREF(p);
              } else if (Py_IsInitialized() != 0) {
                // Never wait for the GIL here: the interpreter drops it at its next check.
                (void)Py_AddPendingCall(
                    [](void* q) -> int {
                      Py_DECREF(static_cast<PyObject*>(q));
                      return 0;
                    },
                    p);
              }
            }} {}

namespace {
// The first BaseException (not an Exception) a callback raised on this thread since the
// driver last looked: type, value, traceback.
thread_local PyObject* kept_type = nullptr;
thread_local PyObject* kept_value = nullptr;
thread_local PyObject* kept_traceback = nullptr;
}  // namespace

void report_callback_error(const char* where) {
  if (PyErr_ExceptionMatches(PyExc_Exception) != 0) {
    const std::string context = std::string{"netio3 "} + where;
    PyObject* text = PyUnicode_FromString(context.c_str());
    PyErr_WriteUnraisable(text);
    Py_XDECREF(text);
    return;
  }
  if (kept_type != nullptr) {
    PyErr_Clear();  // one is enough
    return;
  }
  PyErr_Fetch(&kept_type, &kept_value, &kept_traceback);
}

bool has_kept_error() noexcept {
  return kept_type != nullptr;
}

void raise_kept_error() {
  if (kept_type == nullptr) return;
  PyErr_Restore(kept_type, kept_value, kept_traceback);
  kept_type = nullptr;
  kept_value = nullptr;
  kept_traceback = nullptr;
  throw py::error_already_set();
}

HeldBuffer::HeldBuffer(py::handle object, bool writable) {
  const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(object.ptr(), &m_view, flags) == 0) {
    m_held = true;
    return;
  }
  if (PyObject_CheckBuffer(object.ptr()) == 0) {
    PyErr_Clear();
    throw py::type_error(std::string{"netio3 sends buffer-protocol objects (bytes, bytearray, "
                                     "memoryview, numpy arrays), not "} +
                         Py_TYPE(object.ptr())->tp_name);
  }
  // numpy says ValueError, memoryview BufferError: one exception for one reason.
  const py::error_already_set error;
  throw py::buffer_error(std::string{"netio3 needs a C-contiguous"} +
                         (writable ? " writable" : "") + " buffer: " + error.what());
}

}  // namespace netio3::python
