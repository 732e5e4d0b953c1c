#pragma once

// A UCP context and worker of a test's own, over UCX's tcp transport: the peers the tests play
// that are not netio3 (a stranger with a worker of its own, netio3 of an older protocol).
// Header-only, for the tests and helper programs that link UCX.

#include <chrono>
#include <cstdint>
#include <ucp/api/ucp.h>
#include <vector>

namespace netio3::test {

class UcpWorker {
 public:
  explicit UcpWorker(ucs_thread_mode_t mode = UCS_THREAD_MODE_SINGLE) {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return;
    ucp_config_modify(config, "TLS", "tcp");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    m_ok = ucp_init(&params, config, &m_context) == UCS_OK;
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = mode;
    m_ok = m_ok && ucp_worker_create(m_context, &wp, &m_worker) == UCS_OK;
  }
  // Closes `ep` (by force) if it is set, then the worker and the context.
  ~UcpWorker() {
    if (ep != nullptr && m_worker != nullptr) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      (void)wait(ucp_ep_close_nbx(ep, &param), std::chrono::seconds{2});
    }
    if (m_worker != nullptr) ucp_worker_destroy(m_worker);
    if (m_context != nullptr) ucp_cleanup(m_context);
  }
  UcpWorker(const UcpWorker&) = delete;
  UcpWorker& operator=(const UcpWorker&) = delete;
  UcpWorker(UcpWorker&&) = delete;
  UcpWorker& operator=(UcpWorker&&) = delete;

  [[nodiscard]] bool ok() const noexcept { return m_ok; }
  [[nodiscard]] ucp_worker_h get() const noexcept { return m_worker; }

  // Its worker address.
  [[nodiscard]] std::vector<std::uint8_t> address() const {
    ucp_address_t* address = nullptr;
    std::size_t length = 0;
    if (ucp_worker_get_address(m_worker, &address, &length) != UCS_OK) return {};
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(address);  // NOLINT
    std::vector<std::uint8_t> out(bytes, bytes + length);
    ucp_worker_release_address(m_worker, address);
    return out;
  }

  // Progresses the worker until `request` completed, at most `limit` (then it is cancelled);
  // frees it. True when it completed with UCS_OK (a null request completed at once).
  bool wait(ucs_status_ptr_t request, std::chrono::steady_clock::duration limit) {
    if (request == nullptr) return true;
    if (UCS_PTR_IS_ERR(request)) return false;
    const auto until = std::chrono::steady_clock::now() + limit;
    ucs_status_t status = UCS_INPROGRESS;
    while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < until) {
      ucp_worker_progress(m_worker);
    }
    if (status == UCS_INPROGRESS) {
      ucp_request_cancel(m_worker, request);
      while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(m_worker);
    }
    ucp_request_free(request);
    return status == UCS_OK;
  }

  ucp_ep_h ep{nullptr};  // an endpoint the test made, closed by the destructor

 private:
  bool m_ok{false};
  ucp_context_h m_context{nullptr};
  ucp_worker_h m_worker{nullptr};
};

}  // namespace netio3::test
