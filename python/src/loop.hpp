#pragma once

// netio3.EpollEventLoop for Python. Python never runs the C++ loop's blocking run(): every
// driver attaches the loop to its thread and runs rounds (EpollEventLoop::run_once) with the
// GIL held, so callbacks call Python without waiting for the GIL, and the GIL is released
// only while the thread sleeps on the loop's descriptor. Drivers:
//  - run(): on the calling thread until stop() (the loop on a thread of its own, or the
//    main thread); Ctrl-C raises KeyboardInterrupt out of it;
//  - attach() / run_once() / detach() with fileno(): a host loop (netio3.aio reads fileno()
//    from the asyncio loop and calls run_once() when it is readable).

#include <atomic>
#include <memory>
#include <thread>

#include <netio3/netio3.hpp>

#include "support.hpp"

namespace netio3::python {

class Loop {
 public:
  Loop() : m_loop{std::make_shared<EpollEventLoop>(EpollEventLoop::Options{})} {}
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;
  Loop(Loop&&) = delete;
  Loop& operator=(Loop&&) = delete;
  ~Loop() = default;

  [[nodiscard]] const std::shared_ptr<EpollEventLoop>& get() const noexcept { return m_loop; }

  void run();
  void stop() noexcept;
  void attach();
  bool run_once();
  void detach();
  [[nodiscard]] int fileno() const noexcept { return m_loop->fd(); }
  [[nodiscard]] bool is_running() const noexcept { return m_loop->is_running(); }
  [[nodiscard]] bool in_loop_thread() const noexcept { return m_loop->in_loop_thread(); }

  void post(py::object fn);
  void run_sync(py::object fn);

  // For the backends: an API call made on the attached thread outside a round leaves work
  // for the loop (a send to flush, a report to post); the next round must come even if no
  // descriptor becomes ready. Wakes the loop's descriptor once until that round.
  void note_api_call() {
    if (!m_in_round && m_loop->in_loop_thread() && !m_kick_pending.exchange(true)) {
      m_loop->post([] {});
    }
  }
  // True on the loop's thread while it does not run a round (its calls need note_api_call).
  [[nodiscard]] bool outside_round_on_loop_thread() const noexcept {
    return !m_in_round && m_loop->in_loop_thread();
  }

 private:
  bool round();

  std::shared_ptr<EpollEventLoop> m_loop;
  std::atomic<bool> m_stop{false};
  std::atomic<bool> m_kick_pending{false};
  bool m_in_round{false};  // loop thread only
};

// Registers netio3.EpollEventLoop and its timer and signal handles.
void bind_loop(py::module_& m);

}  // namespace netio3::python
