#include "test_support.hpp"

#include <arpa/inet.h>
#include <cerrno>
#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <future>
#include <netinet/in.h>
#include <stdexcept>
#include <sys/socket.h>
#include <system_error>
#include <tuple>
#include <unistd.h>

namespace netio3::test {

const std::string& test_address() {
  static const std::string address = [] {
    const char* env = std::getenv("NETIO3_TEST_ADDRESS");
    return std::string{env != nullptr && *env != '\0' ? env : "127.0.0.1"};
  }();
  return address;
}

std::size_t open_fd_count() {
  std::size_t n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n - 1;  // the DIR's own descriptor
}

std::size_t rss_bytes() {
  std::ifstream statm{"/proc/self/statm"};
  std::size_t pages_total = 0;
  std::size_t pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

namespace {

// Binds a TCP socket to 127.0.0.1:0 (listening if `listen`); returns the fd and the port.
std::pair<int, std::uint16_t> bind_loopback(bool listen) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  auto* generic = reinterpret_cast<sockaddr*>(&addr);  // NOLINT(*-reinterpret-cast): BSD API
  if (::bind(fd, generic, sizeof(addr)) != 0 || (listen && ::listen(fd, 16) != 0) ||
      ::getsockname(fd, generic, &len) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::system_error(err, std::generic_category(), "bind/listen on 127.0.0.1:0");
  }
  return {fd, ntohs(addr.sin_port)};
}

}  // namespace

RawListener::RawListener() {
  std::tie(m_fd, m_port) = bind_loopback(true);
}

RawListener::~RawListener() {
  ::close(m_fd);
}

std::uint16_t unused_port() {
  const auto [fd, port] = bind_loopback(false);
  ::close(fd);
  return port;
}

LoopThread::LoopThread()
    : m_loop{std::make_shared<EpollEventLoop>()}, m_thread{[loop = m_loop] { loop->run(); }} {
  // Return only once run() dispatches: otherwise a run_sync() right after construction
  // would run inline on the caller (the loop "is not running" yet) and race with it.
  std::promise<void> running;
  auto started = running.get_future();
  m_loop->post([&running] { running.set_value(); });
  if (started.wait_for(DEFAULT_TIMEOUT) != std::future_status::ready) {
    throw std::runtime_error("LoopThread: the event loop did not start");
  }
}

LoopThread::~LoopThread() {
  stop();
}

void LoopThread::stop() {
  if (!m_thread.joinable()) return;
  m_loop->stop();
  m_thread.join();
}

NetworkConfig Recorder::config(ThreadSafetyModel model, NetworkMode mode) {
  NetworkConfig config{.mode = mode, .thread_safety = model};
  config.on_data_cb = [this](std::span<const std::uint8_t> data) {
    record(Event{.kind = Kind::DATA, .size = data.size()}, data);
  };
  config.on_connection_established_cb = [this](const EndPointAddress& remote,
                                               EndpointCapabilities caps) {
    record(Event{.kind = Kind::ESTABLISHED, .remote = remote, .caps = caps}, {});
  };
  config.on_connection_closed_cb = [this](const EndPointAddress& remote,
                                          const std::vector<std::uint64_t>& keys) {
    record(Event{.kind = Kind::CLOSED, .remote = remote, .keys = keys}, {});
  };
  config.on_connection_refused_cb = [this](const EndPointAddress& remote) {
    record(Event{.kind = Kind::REFUSED, .remote = remote}, {});
  };
  config.on_send_completed_cb = [this](const EndPointAddress& remote, std::uint64_t key) {
    record(Event{.kind = Kind::COMPLETED, .remote = remote, .key = key}, {});
  };
  return config;
}

void Recorder::set_hook(std::function<void(const Event&, std::span<const std::uint8_t>)> hook) {
  const std::lock_guard lock{m_mutex};
  m_hook = std::move(hook);
}

void Recorder::record(Event event, std::span<const std::uint8_t> bytes) {
  event.thread = std::this_thread::get_id();
  std::function<void(const Event&, std::span<const std::uint8_t>)> hook;
  {
    const std::lock_guard lock{m_mutex};
    if (event.kind == Kind::DATA) {
      m_bytes += bytes.size();
      if (m_keep_data) m_data.emplace_back(bytes.begin(), bytes.end());
    }
    m_events.push_back(event);
    hook = m_hook;
  }
  m_cv.notify_all();
  if (hook) hook(event, bytes);
}

bool Recorder::wait(const std::function<bool(const Recorder&)>& pred,
                    std::chrono::milliseconds timeout) {
  std::unique_lock lock{m_mutex};
  return m_cv.wait_for(lock, timeout, [&] { return pred(*this); });
}

std::size_t Recorder::count(Kind kind) const {
  std::size_t n = 0;
  for (const auto& e : m_events) n += e.kind == kind ? 1 : 0;
  return n;
}

std::size_t Recorder::count(Kind kind, const EndPointAddress& remote) const {
  std::size_t n = 0;
  for (const auto& e : m_events) n += (e.kind == kind && e.remote == remote) ? 1 : 0;
  return n;
}

std::size_t Recorder::count_now(Kind kind) const {
  const std::lock_guard lock{m_mutex};
  return count(kind);
}

std::vector<Recorder::Event> Recorder::snapshot() const {
  const std::lock_guard lock{m_mutex};
  return m_events;
}

std::vector<std::vector<std::uint8_t>> Recorder::messages_snapshot() const {
  const std::lock_guard lock{m_mutex};
  return m_data;
}

std::uint64_t Recorder::bytes_received() const {
  const std::lock_guard lock{m_mutex};
  return m_bytes;
}

std::vector<std::uint8_t> pattern(std::uint64_t index, std::size_t size) {
  std::vector<std::uint8_t> out(size);
  std::uint64_t x = index * 0x9E3779B97F4A7C15ULL + 1;
  for (std::size_t i = 0; i < size; ++i) {
    x ^= x << 13U;
    x ^= x >> 7U;
    x ^= x << 17U;
    out[i] = static_cast<std::uint8_t>(x);
  }
  return out;
}

bool matches_pattern(std::span<const std::uint8_t> bytes, std::uint64_t index) {
  const auto expected = pattern(index, bytes.size());
  return std::equal(bytes.begin(), bytes.end(), expected.begin());
}

}  // namespace netio3::test
