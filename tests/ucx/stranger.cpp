// netio3_ucx_stranger PORT [MESSAGES]: a process with a UCP worker of its own that knows only
// the port of another process's UCX tcp listener (a port scan finds it). It forges a worker
// address - its own, with its own tcp port replaced by PORT - connects with peer error
// handling (its keepalive then asks about endpoint ids the other side does not know, in the
// same read as its messages), sends MESSAGES active messages on netio3's id, stays on the
// line a moment, closes and exits. Exit status 0 when it got that far.

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ucp/api/ucp.h>
#include <vector>

#include "proc_sockets.hpp"
#include "ucp_worker.hpp"

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PORT [MESSAGES]\n", argv[0]);
    return 2;
  }
  const unsigned port = static_cast<unsigned>(std::strtoul(argv[1], nullptr, 10));
  const int messages = argc > 2 ? std::atoi(argv[2]) : 20;
  netio3::test::UcpWorker worker;
  if (!worker.ok()) return 3;
  std::vector<std::uint8_t> address = worker.address();
  if (address.empty()) return 3;
  int replaced = 0;
  for (const unsigned mine : netio3::test::listening_ports("self")) {
    for (std::size_t i = 0; i + 1 < address.size(); ++i) {
      if (address[i] == (mine >> 8U) && address[i + 1] == (mine & 0xFFU)) {
        address[i] = static_cast<std::uint8_t>(port >> 8U);
        address[i + 1] = static_cast<std::uint8_t>(port & 0xFFU);
        ++replaced;
      }
    }
  }
  if (replaced == 0) {
    std::fprintf(stderr, "stranger: its own port is not in its address\n");
    return 4;
  }
  address.resize(address.size() + 256, 0);  // UCX reads the address without its length
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                         UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());  // NOLINT
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep_params.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};
  if (ucp_ep_create(worker.get(), &ep_params, &worker.ep) != UCS_OK) return 5;
  std::array<std::uint8_t, 24> header{3, 3};
  std::vector<std::uint8_t> payload(256, 0x5A);
  for (int i = 0; i < messages; ++i) {
    header[16] = static_cast<std::uint8_t>(i + 1);
    ucp_request_param_t param{};
    (void)worker.wait(ucp_am_send_nbx(worker.ep, 7, header.data(), header.size(), payload.data(),
                                      payload.size(), &param),
                      std::chrono::seconds{1});
  }
  const auto linger = Clock::now() + std::chrono::milliseconds{150};
  while (Clock::now() < linger) ucp_worker_progress(worker.get());
  ucp_request_param_t close_param{};  // a close that flushes, as a process that goes
  (void)worker.wait(ucp_ep_close_nbx(worker.ep, &close_param), std::chrono::seconds{1});
  worker.ep = nullptr;
  std::printf("stranger: done\n");
  return 0;
}
