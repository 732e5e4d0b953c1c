// netio3_ucx_stranger PORT [MESSAGES]: a process with a UCP worker of its own that knows only
// the port of another process's UCX tcp listener (a port scan finds it). It forges a worker
// address - its own, with its own tcp port replaced by PORT - connects with peer error
// handling (its keepalive then asks about endpoint ids the other side does not know, in the
// same read as its messages), sends MESSAGES active messages on netio3's id, stays on the
// line a moment, closes and exits. Exit status 0 when it got that far; what UCX took of the
// messages is printed.

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <ucp/api/ucp.h>
#include <unistd.h>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

std::set<unsigned> own_listening_ports() {
  std::set<std::string> inodes;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (const dirent* entry = ::readdir(dir)) {
      std::array<char, 128> target{};
      const std::string link = std::string{"/proc/self/fd/"} + entry->d_name;
      const ssize_t n = ::readlink(link.c_str(), target.data(), target.size() - 1);
      if (n <= 0) continue;
      const std::string text{target.data(), static_cast<std::size_t>(n)};
      if (text.rfind("socket:[", 0) == 0) inodes.insert(text.substr(8, text.size() - 9));
    }
    ::closedir(dir);
  }
  std::set<unsigned> ports;
  for (const char* name : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream table{name};
    std::string line;
    std::getline(table, line);
    while (std::getline(table, line)) {
      std::istringstream fields{line};
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state == "0A" && inodes.contains(inode)) {
        ports.insert(
            static_cast<unsigned>(std::stoul(local.substr(local.find(':') + 1), nullptr, 16)));
      }
    }
  }
  return ports;
}

void progress_until(ucp_worker_h worker, void* request, Clock::duration limit) {
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  const auto until = Clock::now() + limit;
  while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < until) {
    ucp_worker_progress(worker);
  }
  if (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_request_cancel(worker, request);
  while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker);
  ucp_request_free(request);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PORT [MESSAGES]\n", argv[0]);
    return 2;
  }
  const unsigned port = static_cast<unsigned>(std::strtoul(argv[1], nullptr, 10));
  const int messages = argc > 2 ? std::atoi(argv[2]) : 20;
  ucp_config_t* config = nullptr;
  ucp_config_read(nullptr, nullptr, &config);
  ucp_config_modify(config, "TLS", "tcp");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  if (ucp_init(&params, config, &context) != UCS_OK) return 3;
  ucp_config_release(config);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (ucp_worker_create(context, &wp, &worker) != UCS_OK) return 3;
  ucp_address_t* own = nullptr;
  std::size_t length = 0;
  if (ucp_worker_get_address(worker, &own, &length) != UCS_OK) return 3;
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(own);  // NOLINT
  std::vector<std::uint8_t> address(bytes, bytes + length);
  ucp_worker_release_address(worker, own);
  int replaced = 0;
  for (const unsigned mine : own_listening_ports()) {
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
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) return 5;
  std::array<std::uint8_t, 24> header{3, 3};
  std::vector<std::uint8_t> payload(256, 0x5A);
  for (int i = 0; i < messages; ++i) {
    header[16] = static_cast<std::uint8_t>(i + 1);
    ucp_request_param_t param{};
    progress_until(worker,
                   ucp_am_send_nbx(ep, 7, header.data(), header.size(), payload.data(),
                                   payload.size(), &param),
                   std::chrono::seconds{1});
  }
  const auto linger = Clock::now() + std::chrono::milliseconds{150};
  while (Clock::now() < linger) ucp_worker_progress(worker);
  ucp_request_param_t close_param{};
  progress_until(worker, ucp_ep_close_nbx(ep, &close_param), std::chrono::seconds{1});
  ucp_worker_destroy(worker);
  ucp_cleanup(context);
  std::printf("stranger: done\n");
  return 0;
}
