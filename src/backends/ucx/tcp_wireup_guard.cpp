// A guard against a crash of UCX 1.13's tcp transport that any process reaching a UCX port can
// cause (docs/ucx.md, "Strangers and UCX 1.13's tcp transport").
//
// The defect: uct_tcp_ep_progress_am_rx hands each active message of a receive buffer to its
// handler in a loop. When UCP's wire-up handler creates an endpoint to the sender from there
// (a wire-up REQUEST, or the reply to an EP_CHECK for an endpoint id the worker does not know,
// which a stranger's keepalive sends), the tcp transport moves the connection's socket and the
// rest of the receive buffer to that new endpoint (uct_tcp_ep_replace_ep, uct_tcp_ep_ctx_move)
// and the loop then returns a NULL buffer to its pool: SIGSEGV at 0xfffffffffffffff8. UCX 1.14
// fixed it (the loop stops when the buffer was taken); Debian 12 ships 1.13.1.
//
// The guard keeps UCP's wire-up messages on tcp interfaces out of that loop: the handler UCP
// registers for them is replaced by one that copies each message into a queue, and a one-shot
// callback of the UCT worker's progress hands them to UCP's handler, in order, outside the
// receive loop (ucp_worker_progress calls uct_worker_progress, which netio3 calls on its loop).
// It does so by defining the three UCT functions UCP calls through its procedure linkage table
// - uct_iface_open, uct_iface_set_am_handler, uct_iface_close - which forward to UCX's own
// (dlsym RTLD_NEXT). They are found before libuct's because libnetio3 (or a program linking
// netio3 statically) comes before it in the lookup order. Only for UCX 1.13, where the wire-up
// message's id is known to be 1; NETIO3_UCX_TCP_WIREUP_GUARD=0 turns it off.

#include "backends/ucx/tcp_wireup_guard.hpp"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <dlfcn.h>
#include <memory>
#include <mutex>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/log.hpp"

namespace netio3::ucx {
namespace {

// UCP's active message id of wire-up messages in UCX 1.13 (UCP_AM_ID_WIREUP).
constexpr std::uint8_t WIREUP_AM_ID = 1;

std::atomic<std::uint64_t> g_guarded_interfaces{0};

bool wanted() {
  static const bool on = [] {
    const char* env = std::getenv("NETIO3_UCX_TCP_WIREUP_GUARD");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    unsigned major = 0;
    unsigned minor = 0;
    unsigned release = 0;
    ucp_get_version(&major, &minor, &release);
    return major == 1 && minor == 13;
  }();
  return on;
}

template <typename F>
F next_definition(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));  // NOLINT
}

// The wire-up messages of one tcp interface, waiting for the worker's progress. UCX's own
// locks come first: `mutex` is never held while calling into UCX (UCX calls the handlers and
// uct_iface_set_am_handler with its worker's locks held).
struct Deferred {
  std::mutex mutex;
  uct_worker_h worker{};                               // under mutex
  uct_am_callback_t handler{};                         // under mutex
  void* arg{};                                         // under mutex
  std::deque<std::vector<std::uint8_t>> queue;         // under mutex
  bool scheduled{false};                               // under mutex: hand_over is due
  uct_worker_cb_id_t callback{UCS_CALLBACKQ_ID_NULL};  // under mutex: its id
};

struct Interfaces {
  std::mutex mutex;
  std::unordered_map<uct_iface_h, uct_worker_h> tcp;  // tcp interfaces and their workers
  std::unordered_map<uct_iface_h, std::unique_ptr<Deferred>> deferred;
};

Interfaces& interfaces() {
  static auto* all = new Interfaces;  // never destroyed: UCX may close interfaces at exit
  return *all;
}

unsigned hand_over(void* arg) {
  auto* d = static_cast<Deferred*>(arg);
  std::deque<std::vector<std::uint8_t>> batch;
  uct_am_callback_t handler = nullptr;
  void* handler_arg = nullptr;
  {
    const std::lock_guard lock{d->mutex};
    batch.swap(d->queue);
    d->scheduled = false;  // one-shot: UCX removed it before this call
    d->callback = UCS_CALLBACKQ_ID_NULL;
    handler = d->handler;
    handler_arg = d->arg;
  }
  for (auto& message : batch) {
    // Flags 0: the data is not UCX's descriptor, the handler must not keep it (UCP's wire-up
    // handler never does).
    (void)handler(handler_arg, message.data(), message.size(), 0);
  }
  return static_cast<unsigned>(batch.size());
}

ucs_status_t defer(void* arg, void* data, std::size_t length, unsigned /*flags*/) {
  auto* d = static_cast<Deferred*>(arg);
  bool schedule = false;
  uct_worker_h worker = nullptr;
  {
    const std::lock_guard lock{d->mutex};
    const auto* bytes = static_cast<const std::uint8_t*>(data);
    d->queue.emplace_back(bytes, bytes + length);
    schedule = !std::exchange(d->scheduled, true);
    worker = d->worker;
  }
  if (schedule) {
    uct_worker_cb_id_t id = UCS_CALLBACKQ_ID_NULL;
    uct_worker_progress_register_safe(worker, &hand_over, d, UCS_CALLBACKQ_FLAG_ONESHOT, &id);
    const std::lock_guard lock{d->mutex};
    if (d->scheduled) d->callback = id;  // else hand_over ran already: the id is spent
  }
  return UCS_OK;  // copied: the transport may reuse its buffer
}

}  // namespace

std::uint64_t tcp_wireup_guarded_interfaces() noexcept {
  return g_guarded_interfaces.load(std::memory_order_relaxed);
}

bool tcp_wireup_guard_wanted() noexcept {
  return wanted();
}

}  // namespace netio3::ucx

using netio3::ucx::Deferred;
using netio3::ucx::interfaces;

// NOLINTBEGIN(readability-identifier-naming): UCT's names
extern "C" {

__attribute__((visibility("default"))) ucs_status_t uct_iface_open(uct_md_h md, uct_worker_h worker,
                                                                   const uct_iface_params_t* params,
                                                                   const uct_iface_config_t* config,
                                                                   uct_iface_h* iface_p) {
  static const auto next =
      netio3::ucx::next_definition<decltype(&uct_iface_open)>("uct_iface_open");
  const ucs_status_t status = next(md, worker, params, config, iface_p);
  if (status != UCS_OK || !netio3::ucx::wanted()) return status;
  uct_md_attr_t attr{};
  if (uct_md_query(md, &attr) == UCS_OK && std::strcmp(attr.component_name, "tcp") == 0) {
    auto& all = interfaces();
    const std::lock_guard lock{all.mutex};
    all.tcp[*iface_p] = worker;
  }
  return status;
}

__attribute__((visibility("default"))) ucs_status_t uct_iface_set_am_handler(
    uct_iface_h iface, std::uint8_t id, uct_am_callback_t cb, void* arg, std::uint32_t flags) {
  static const auto next =
      netio3::ucx::next_definition<decltype(&uct_iface_set_am_handler)>("uct_iface_set_am_handler");
  if (id == netio3::ucx::WIREUP_AM_ID && cb != nullptr) {
    Deferred* deferred = nullptr;  // lives until uct_iface_close of this interface
    {
      auto& all = interfaces();
      const std::lock_guard lock{all.mutex};
      if (const auto it = all.tcp.find(iface); it != all.tcp.end()) {
        auto& d = all.deferred[iface];
        if (!d) d = std::make_unique<Deferred>();
        const std::lock_guard handler_lock{d->mutex};
        d->worker = it->second;
        d->handler = cb;  // UCP's handler, its proxy (an inactive interface) or its stub
        d->arg = arg;
        deferred = d.get();
      }
    }
    if (deferred != nullptr) {
      netio3::ucx::g_guarded_interfaces.fetch_add(1, std::memory_order_relaxed);
      // Not UCT_CB_FLAG_ASYNC: the copy is handed over from the worker's progress.
      return next(iface, id, &netio3::ucx::defer, deferred, flags & ~UCT_CB_FLAG_ASYNC);
    }
  }
  return next(iface, id, cb, arg, flags);
}

__attribute__((visibility("default"))) void uct_iface_close(uct_iface_h iface) {
  static const auto next =
      netio3::ucx::next_definition<decltype(&uct_iface_close)>("uct_iface_close");
  std::unique_ptr<Deferred> d;
  {
    auto& all = interfaces();
    const std::lock_guard lock{all.mutex};
    all.tcp.erase(iface);
    if (const auto it = all.deferred.find(iface); it != all.deferred.end()) {
      d = std::move(it->second);
      all.deferred.erase(it);
    }
  }
  if (d) {
    uct_worker_cb_id_t id = UCS_CALLBACKQ_ID_NULL;
    uct_worker_h worker = nullptr;
    {
      const std::lock_guard lock{d->mutex};
      if (d->scheduled) id = d->callback;
      worker = d->worker;
    }
    if (id != UCS_CALLBACKQ_ID_NULL) uct_worker_progress_unregister_safe(worker, &id);
  }
  next(iface);
}

}  // extern "C"
// NOLINTEND(readability-identifier-naming)
