#include "loop.hpp"

#include <cerrno>
#include <chrono>
#include <optional>
#include <poll.h>
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <stdexcept>

namespace netio3::python {

bool Loop::round() {
  if (m_in_round) throw std::logic_error("EpollEventLoop.run_once: called from inside a round");
  m_kick_pending.store(false);
  m_in_round = true;
  bool may_sleep = true;
  try {
    may_sleep = m_loop->run_once();
  } catch (...) {
    m_in_round = false;
    throw;
  }
  m_in_round = false;
  raise_kept_error();
  return may_sleep;
}

void Loop::run() {
  m_loop->attach();  // throws if it runs (or is attached) already
  const auto finish = [this] {
    m_stop.store(false);
    m_loop->detach();
  };
  try {
    while (!m_stop.load()) {
      const bool may_sleep = round();
      if (m_stop.load()) break;
      int ready = 1;
      if (may_sleep) {
        // Asleep without the GIL; stop(), post() and the transports wake the descriptor.
        const py::gil_scoped_release release;
        pollfd p{.fd = m_loop->fd(), .events = POLLIN, .revents = 0};
        ready = ::poll(&p, 1, -1);
      }
      // Ctrl-C (on the main thread): the signal ends the poll with EINTR and Python's
      // handler raises here.
      if ((ready < 0 && errno == EINTR) || !may_sleep) {
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      }
    }
  } catch (...) {
    finish();
    throw;
  }
  finish();
}

void Loop::stop() noexcept {
  m_stop.store(true);
  m_loop->stop();  // wakes the descriptor
}

void Loop::attach() {
  m_loop->attach();
}

bool Loop::run_once() {
  return round();
}

void Loop::detach() {
  m_loop->detach();
  m_stop.store(false);
}

void Loop::post(py::object fn) {
  SharedRef ref{std::move(fn)};
  m_loop->post([ref] {
    const py::gil_scoped_acquire gil;
    call_guarded("EpollEventLoop.post function", ref.handle());
  });
}

void Loop::run_sync(py::object fn) {
  if (m_loop->in_loop_thread()) {
    fn();
    return;
  }
  SharedRef ref{std::move(fn)};
  std::optional<py::error_already_set> error;
  {
    const py::gil_scoped_release release;
    m_loop->run_sync([&] {
      const py::gil_scoped_acquire gil;
      try {
        py::handle{ref.handle()}();
      } catch (py::error_already_set& e) {
        error.emplace(std::move(e));
      }
    });
  }
  if (error) throw std::move(*error);
}

void bind_loop(py::module_& m) {
  py::class_<EventTimerHandle>(m, "EventTimer",
                               "A timer of an EpollEventLoop (EpollEventLoop.create_timer).")
      .def(
          "start", [](EventTimerHandle& t, py::handle period) { t.start(to_milliseconds(period)); },
          py::arg("period"), "Fires every `period` seconds (or timedelta) until stop().")
      .def(
          "start_once",
          [](EventTimerHandle& t, py::handle delay) { t.start_once(to_milliseconds(delay)); },
          py::arg("delay"), "Fires once after `delay` seconds (or timedelta).")
      .def(
          "stop", [](EventTimerHandle& t) { t.stop(); },
          "Stops the timer; it may be started again.")
      .def(
          "close", [](EventTimerHandle& t) { t.close(); }, "Removes the timer from its loop.");

  py::class_<EventSignalHandle>(m, "EventSignal",
                                "A signal of an EpollEventLoop (EpollEventLoop.create_signal).")
      .def(
          "fire", [](EventSignalHandle& s) { s.fire(); },
          "From any thread: the callback runs on the loop thread (fires coalesce).")
      .def(
          "close", [](EventSignalHandle& s) { s.close(); }, "Removes the signal from its loop.");

  py::class_<Loop, std::shared_ptr<Loop>>(m, "EpollEventLoop", R"doc(
The event loop every netio3 backend runs on. Callbacks run on the thread that drives it:

- run(): on the calling thread until stop() (for a loop on a thread of its own, or a
  program whose main thread is the loop); Ctrl-C raises KeyboardInterrupt out of it;
- attach() / run_once() / detach() with fileno(): driven by a host loop, as netio3.aio does
  with asyncio's loop.

The GIL is held while the loop handles events (callbacks call Python directly) and released
while it sleeps.)doc")
      .def(py::init<>())
      .def("run", &Loop::run,
           "Handles events on this thread until stop(); returns at once if stop() came first.")
      .def("stop", &Loop::stop, "Any thread: makes run() return.")
      .def("attach", &Loop::attach,
           "Makes this thread the loop thread for a host loop (run_once, fileno) until detach().")
      .def("run_once", &Loop::run_once,
           "One round without blocking, on the attached thread: handles what is ready. Returns "
           "True when the loop may sleep until fileno() is readable, False when it has more "
           "to do now.")
      .def("detach", &Loop::detach, "Ends attach(): runs what was posted, releases the thread.")
      .def("fileno", &Loop::fileno, "The descriptor that is readable when run_once() has work.")
      .def("is_running", &Loop::is_running, "True while run() runs or the loop is attached.")
      .def("in_loop_thread", &Loop::in_loop_thread, "True on the thread that drives the loop.")
      .def("post", &Loop::post, py::arg("fn"),
           "Any thread: runs fn() on the loop thread soon, in posting order.")
      .def("run_sync", &Loop::run_sync, py::arg("fn"),
           "Runs fn() on the loop thread and waits for it (the GIL is released meanwhile); at "
           "once on the loop thread. fn's exception is raised here.")
      .def(
          "create_timer",
          [](Loop& loop, py::object fn) {
            SharedRef ref{std::move(fn)};
            return loop.get()->create_timer([ref] {
              const py::gil_scoped_acquire gil;
              call_guarded("timer callback", ref.handle());
            });
          },
          py::arg("fn"), "A timer that calls fn() on the loop thread; stopped until started.")
      .def(
          "create_signal",
          [](Loop& loop, py::object fn) {
            SharedRef ref{std::move(fn)};
            return loop.get()->create_signal([ref] {
              const py::gil_scoped_acquire gil;
              call_guarded("signal callback", ref.handle());
            });
          },
          py::arg("fn"), "A signal whose fire() (any thread) calls fn() on the loop thread.")
      .def_property_readonly(
          "wakeups", [](const Loop& loop) { return loop.get()->wakeups(); },
          "How often the loop woke up to handle events.");
}

}  // namespace netio3::python
