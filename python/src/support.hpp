#pragma once

// What the bindings share: addresses as Python objects, Python references that C++ code may
// drop without the GIL, the errors of Python callbacks, buffers held for zero-copy sends.

#include <Python.h>
#include <chrono>
#include <cstdint>
#include <memory>
#include <pybind11/pybind11.h>
#include <string>
#include <unordered_map>
#include <utility>

#include <netio3/netio3.hpp>

namespace netio3::python {

namespace py = pybind11;

// ---- addresses ------------------------------------------------------------------------

// netio3.EndPointAddress: a named tuple (address, port), made once at import.
py::object& address_type();
// EndPointAddress from a named tuple, a (address, port) tuple or list, or any object with
// .address and .port. Throws TypeError otherwise.
EndPointAddress to_address(py::handle object);
py::object to_python(const EndPointAddress& address);

// ---- durations ---------------------------------------------------------------------------

// Python gives durations as seconds (an int or a float, as asyncio and socket timeouts do) or
// a datetime.timedelta; TypeError otherwise.
std::chrono::milliseconds to_milliseconds(py::handle seconds);
// Seconds, as a float.
double to_seconds(std::chrono::milliseconds duration);

// ---- references the C++ side may drop without the GIL ---------------------------------

// A strong reference to a Python object that C++ code copies into callbacks and closures:
// copies are plain shared_ptr copies; the last one releases the object with the GIL held, or
// hands it to the interpreter (Py_AddPendingCall) when the thread does not hold the GIL, so
// that no thread of netio3 ever waits for the GIL to drop a reference.
class SharedRef {
 public:
  SharedRef() = default;
  explicit SharedRef(py::object object);
  [[nodiscard]] PyObject* get() const noexcept { return m_ref ? m_ref.get() : nullptr; }
  [[nodiscard]] py::handle handle() const noexcept { return py::handle{get()}; }
  explicit operator bool() const noexcept { return m_ref != nullptr && m_ref.get() != Py_None; }

 private:
  std::shared_ptr<PyObject> m_ref;
};

// ---- errors raised by Python callbacks ---------------------------------------------------

// An exception raised by a Python callback has nowhere to go (the callback runs on the loop,
// not inside the call that caused it): an Exception goes to sys.unraisablehook (pytest turns
// it into a warning, -W error into a failure); a BaseException that is not an Exception
// (KeyboardInterrupt, SystemExit) is kept and raised again by the loop's driver (run,
// run_once) once the round is over.
void report_callback_error(const char* where);
// Raises (error_already_set) what report_callback_error kept on this thread, if anything.
void raise_kept_error();
[[nodiscard]] bool has_kept_error() noexcept;

// Calls `callable(args...)`; an exception is reported (report_callback_error). GIL held.
template <typename... Args>
void call_guarded(const char* where, py::handle callable, Args&&... args) {
  // Held for the call: the callback may drop the last other reference to itself (closing
  // its backend).
  const py::object held = py::reinterpret_borrow<py::object>(callable);
  PyObject* result = PyObject_CallFunctionObjArgs(held.ptr(), args..., nullptr);
  if (result == nullptr) {
    report_callback_error(where);
    return;
  }
  Py_DECREF(result);
}

// ---- buffers lent by Python objects -----------------------------------------------------

// A buffer-protocol view of a Python object (PyObject_GetBuffer): the object stays alive and,
// for a bytearray, cannot be resized until it is released. Move-only; releases with the GIL
// held (the bindings only destroy it there).
class HeldBuffer {
 public:
  HeldBuffer() = default;
  // C-contiguous, read-only or `writable`. Throws BufferError/TypeError (error_already_set)
  // for an object that cannot give one.
  HeldBuffer(py::handle object, bool writable);
  ~HeldBuffer() { release(); }
  HeldBuffer(HeldBuffer&& other) noexcept : m_view{other.m_view}, m_held{other.m_held} {
    other.m_held = false;
  }
  HeldBuffer& operator=(HeldBuffer&& other) noexcept {
    if (this != &other) {
      release();
      m_view = other.m_view;
      m_held = std::exchange(other.m_held, false);
    }
    return *this;
  }
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;

  [[nodiscard]] std::uint8_t* data() const noexcept {
    return static_cast<std::uint8_t*>(m_view.buf);
  }
  [[nodiscard]] std::size_t size() const noexcept {
    return m_held ? static_cast<std::size_t>(m_view.len) : 0;
  }
  [[nodiscard]] bool held() const noexcept { return m_held; }
  void release() noexcept {
    if (m_held) PyBuffer_Release(&m_view);
    m_held = false;
  }

 private:
  Py_buffer m_view{};
  bool m_held{false};
};

}  // namespace netio3::python
