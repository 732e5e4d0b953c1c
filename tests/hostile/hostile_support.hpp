#pragma once

// Shared pieces of the hostile suites: raw TCP attackers, a legitimate netio3 client that
// streams checked messages into the same listener, log capture, and the fixture that ends
// every test with the same checks (the legitimate stream intact and in order, the listener
// still serving, descriptors back to baseline).
//
// Nothing here sleeps to synchronise: waits are on condition variables fed by callbacks,
// on poll() for raw sockets, or (for quantities nothing notifies about: fd counts, kernel
// socket queues) on a condition re-checked until a deadline.

#include <algorithm>
#include <arpa/inet.h>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <functional>
#include <linux/sockios.h>
#include <map>
#include <memory>
#include <mutex>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <poll.h>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <system_error>
#include <thread>
#include <unistd.h>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netio3/log.hpp>
#include <netio3/netio3.hpp>

#include "test_support.hpp"

namespace netio3::hostile {

using namespace std::chrono_literals;
using netio3::BackendType;
using netio3::ConnectionParameters;
using netio3::EndPointAddress;
using netio3::NetioStatus;
using netio3::NetworkBackend;
using netio3::NetworkLimits;
using netio3::NetworkMode;
using netio3::test::Recorder;
using Clock = std::chrono::steady_clock;
using Bytes = std::vector<std::uint8_t>;

// Waits for things that must happen "at once" (a close after bad input, a delivery). The
// tests that are not about the set-up timeout configure a connect_timeout far longer than
// this, so a close seen within it was caused by the input, not by the timeout.
constexpr auto PROMPT = 10s;
constexpr auto PATIENT_CONNECT_TIMEOUT = 120s;
constexpr auto SHORT_CONNECT_TIMEOUT = 300ms;
constexpr std::size_t DEFAULT_MAX = netio3::DEFAULT_MAX_MESSAGE_SIZE;

// ---- wire format, written independently of the library's encoder -----------------------

constexpr std::size_t GREETING_SIZE = 16;
constexpr std::size_t HEADER_SIZE = 8;

inline void put_le16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v & 0xFFU);
  p[1] = static_cast<std::uint8_t>(v >> 8U);
}
inline void put_le32(std::uint8_t* p, std::uint32_t v) {
  for (unsigned i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>((v >> (8U * i)) & 0xFFU);
}
inline std::uint32_t get_le32(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8U) |
         (static_cast<std::uint32_t>(p[2]) << 16U) | (static_cast<std::uint32_t>(p[3]) << 24U);
}
inline void put_le64(std::uint8_t* p, std::uint64_t v) {
  for (unsigned i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>((v >> (8U * i)) & 0xFFU);
}
inline std::uint64_t get_le64(const std::uint8_t* p) {
  return static_cast<std::uint64_t>(get_le32(p)) |
         (static_cast<std::uint64_t>(get_le32(p + 4)) << 32U);
}
// asyncmsg 1.5: the greeting flag that asks the peer to acknowledge, and the ACK frame.
constexpr std::uint32_t GREETING_FLAG_ACKNOWLEDGE = 1U << 3U;
constexpr std::uint8_t FRAME_TYPE_ACK = 7;

inline Bytes greeting(std::uint16_t major = 1, std::uint16_t minor = 0,
                      std::uint32_t max_message = 0xFFFF'FFFFU, std::uint32_t flags = 0) {
  Bytes g(GREETING_SIZE);
  g[0] = 'N';
  g[1] = 'I';
  g[2] = 'O';
  g[3] = '3';
  put_le16(&g[4], major);
  put_le16(&g[6], minor);
  put_le32(&g[8], max_message);
  put_le32(&g[12], flags);
  return g;
}

inline Bytes frame_header(std::uint32_t length, std::uint8_t type = 1,
                          std::array<std::uint8_t, 3> reserved = {0, 0, 0}) {
  Bytes h(HEADER_SIZE);
  put_le32(h.data(), length);
  h[4] = type;
  h[5] = reserved[0];
  h[6] = reserved[1];
  h[7] = reserved[2];
  return h;
}

inline void append(Bytes& out, std::span<const std::uint8_t> bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}

inline Bytes head(Bytes bytes, std::size_t n) {
  bytes.resize(n);
  return bytes;
}

// ---- self-describing test messages ------------------------------------------------------
//
// [u32 stream][u32 seq] followed by netio3::test::pattern(key, size - 8), key = stream:seq.
// Streams tell the legitimate client apart from raw peers that send valid frames, since
// on_data_cb carries no address.

constexpr std::size_t PREFIX = 8;

inline std::uint64_t message_key(std::uint32_t stream, std::uint32_t seq) {
  return (std::uint64_t{stream} << 32U) | seq;
}

inline Bytes make_message(std::uint32_t stream, std::uint32_t seq, std::size_t size) {
  Bytes m(PREFIX);
  put_le32(m.data(), stream);
  put_le32(m.data() + 4, seq);
  append(m, netio3::test::pattern(message_key(stream, seq), size - PREFIX));
  return m;
}

inline Bytes make_frame(std::uint32_t stream, std::uint32_t seq, std::size_t size) {
  Bytes f = frame_header(static_cast<std::uint32_t>(size));
  append(f, make_message(stream, seq, size));
  return f;
}

// Receives every message of the server backend (on the loop thread) and checks each one at
// once: known stream, next sequence number, intact pattern. Kept small on purpose: no copy
// of the data is held, so memory measurements are not disturbed by the bookkeeping.
class StreamChecker {
 public:
  void expect_stream(std::uint32_t stream) {
    const std::lock_guard lock{m_mutex};
    m_next.emplace(stream, 0);
  }

  void on_message(std::span<const std::uint8_t> data) {
    {
      const std::lock_guard lock{m_mutex};
      ++m_total;
      check_locked(data);
    }
    m_cv.notify_all();
  }

  [[nodiscard]] std::uint32_t received(std::uint32_t stream) const {
    const std::lock_guard lock{m_mutex};
    const auto it = m_next.find(stream);
    return it == m_next.end() ? 0 : it->second;
  }

  bool wait_received(std::uint32_t stream, std::uint64_t n, std::chrono::milliseconds timeout) {
    std::unique_lock lock{m_mutex};
    return m_cv.wait_for(lock, timeout, [&] {
      const auto it = m_next.find(stream);
      return !m_errors.empty() || (it != m_next.end() && it->second >= n);
    });
  }

  [[nodiscard]] std::vector<std::string> errors() const {
    const std::lock_guard lock{m_mutex};
    return m_errors;
  }

  [[nodiscard]] std::uint64_t total() const {
    const std::lock_guard lock{m_mutex};
    return m_total;
  }

 private:
  void check_locked(std::span<const std::uint8_t> data) {
    if (data.size() < PREFIX) {
      add_error(fmt::format("message of {} bytes is too short for a test message", data.size()));
      return;
    }
    const std::uint32_t stream = get_le32(data.data());
    const std::uint32_t seq = get_le32(data.data() + 4);
    const auto it = m_next.find(stream);
    if (it == m_next.end()) {
      add_error(fmt::format("message of {} bytes from unexpected stream {} (seq {})", data.size(),
                            stream, seq));
      return;
    }
    if (seq != it->second) {
      add_error(fmt::format("stream {}: got seq {}, expected {}", stream, seq, it->second));
      return;
    }
    if (!netio3::test::matches_pattern(data.subspan(PREFIX), message_key(stream, seq))) {
      add_error(fmt::format("stream {} seq {}: {} bytes corrupted", stream, seq, data.size()));
      return;
    }
    ++it->second;
  }

  void add_error(std::string e) {
    if (m_errors.size() < 20) m_errors.push_back(std::move(e));
  }

  mutable std::mutex m_mutex;
  std::condition_variable m_cv;
  std::map<std::uint32_t, std::uint32_t> m_next;  // stream -> next expected seq
  std::vector<std::string> m_errors;
  std::uint64_t m_total{0};
};

// Captures the library's log lines (at debug level, where every connection event is
// logged with its reason).
class LogCapture {
 public:
  LogCapture() : m_previous{netio3::log_level()} {
    netio3::set_log_level(netio3::LogLevel::debug);
    netio3::set_log_sink([state = m_state](netio3::LogLevel level, std::string_view message) {
      {
        const std::lock_guard lock{state->mutex};
        state->lines.push_back(fmt::format("[{}] {}", netio3::to_string(level), message));
      }
      state->cv.notify_all();
    });
  }
  ~LogCapture() {
    netio3::set_log_sink({});
    netio3::set_log_level(m_previous);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  LogCapture(LogCapture&&) = delete;
  LogCapture& operator=(LogCapture&&) = delete;

  // Waits for a line that names `address` (as "ip:port", not as a prefix of a longer port)
  // and contains one of `reasons`.
  // The waits below run under the mutex the log sink takes on the loop thread, so they
  // look only at lines that arrived since their last look: rescanning everything on each
  // new line would stall the loop (quadratic in the number of lines).
  bool wait_line(const EndPointAddress& address, std::vector<std::string> reasons,
                 std::chrono::milliseconds timeout = PROMPT) {
    std::size_t scanned = 0;
    std::unique_lock lock{m_state->mutex};
    return m_state->cv.wait_for(lock, timeout, [&] {
      for (; scanned < m_state->lines.size(); ++scanned) {
        if (matches(m_state->lines[scanned], address, reasons)) return true;
      }
      return false;
    });
  }

  [[nodiscard]] std::size_t count(const std::string& needle) const {
    const std::lock_guard lock{m_state->mutex};
    return static_cast<std::size_t>(
        std::count_if(m_state->lines.begin(), m_state->lines.end(),
                      [&](const std::string& l) { return l.find(needle) != std::string::npos; }));
  }

  // Waits until every address of `addresses` is named by a line containing `reason`.
  bool wait_all(const std::vector<EndPointAddress>& addresses, const std::string& reason,
                std::chrono::milliseconds timeout) {
    std::vector<EndPointAddress> pending = addresses;
    std::size_t scanned = 0;
    std::unique_lock lock{m_state->mutex};
    return m_state->cv.wait_for(lock, timeout, [&] {
      for (; scanned < m_state->lines.size(); ++scanned) {
        const std::string& line = m_state->lines[scanned];
        if (line.find(reason) == std::string::npos) continue;
        std::erase_if(pending, [&](const EndPointAddress& a) { return names(line, a); });
      }
      return pending.empty();
    });
  }

  [[nodiscard]] std::string dump(std::size_t last = 40) const {
    const std::lock_guard lock{m_state->mutex};
    std::string out = "\n--- last log lines ---\n";
    const std::size_t from = m_state->lines.size() > last ? m_state->lines.size() - last : 0;
    for (std::size_t i = from; i < m_state->lines.size(); ++i) out += m_state->lines[i] + "\n";
    return out;
  }

  static bool names(const std::string& line, const EndPointAddress& address) {
    const std::string text = netio3::to_string(address);
    for (auto pos = line.find(text); pos != std::string::npos; pos = line.find(text, pos + 1)) {
      const std::size_t end = pos + text.size();
      if (end == line.size() || std::isdigit(static_cast<unsigned char>(line[end])) == 0) {
        return true;
      }
    }
    return false;
  }

 private:
  static bool matches(const std::string& line, const EndPointAddress& address,
                      const std::vector<std::string>& reasons) {
    if (!names(line, address)) return false;
    return std::any_of(reasons.begin(), reasons.end(),
                       [&](const std::string& r) { return line.find(r) != std::string::npos; });
  }

  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::vector<std::string> lines;
  };
  std::shared_ptr<State> m_state{std::make_shared<State>()};
  netio3::LogLevel m_previous;
};

inline std::chrono::milliseconds remaining(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, 0ms);
}

inline std::optional<EndPointAddress> socket_address(int fd, bool peer) {
  sockaddr_storage storage{};
  socklen_t len = sizeof(storage);
  auto* sa = reinterpret_cast<sockaddr*>(&storage);  // NOLINT
  if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0) return {};
  if (storage.ss_family != AF_INET) return {};
  sockaddr_in in{};
  std::memcpy(&in, &storage, sizeof(in));
  std::array<char, INET_ADDRSTRLEN> text{};
  ::inet_ntop(AF_INET, &in.sin_addr, text.data(), text.size());
  return EndPointAddress{text.data(), ntohs(in.sin_port)};
}

// The server's own socket for a connection from `peer` to `listen` (this process holds both
// ends), or -1. Used to wait until the server has read everything a raw peer sent.
inline int server_socket_for(const EndPointAddress& listen, const EndPointAddress& peer) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const int fd = std::atoi(entry->d_name);
    const auto local = socket_address(fd, false);
    if (!local || local->port != listen.port) continue;
    const auto remote = socket_address(fd, true);
    if (remote && *remote == peer) {
      found = fd;
      break;
    }
  }
  ::closedir(dir);
  return found;
}

inline std::size_t vm_data_bytes() {
  std::ifstream status{"/proc/self/status"};
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmData:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  }
  return 0;
}

// ---- a raw TCP peer ---------------------------------------------------------------------

class RawPeer {
 public:
  enum class Outcome { CLOSED, RESET, STILL_OPEN };

  // A socket, not yet connected.
  RawPeer() {
    m_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (m_fd < 0) throw std::system_error(errno, std::system_category(), "socket");
  }
  explicit RawPeer(const EndPointAddress& server) : RawPeer() { connect_to(server); }

  void connect_to(const EndPointAddress& server) {
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(server.port);
    ::inet_pton(AF_INET, server.address.c_str(), &sa.sin_addr);
    if (::connect(m_fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) {  // NOLINT
      throw std::system_error(errno, std::system_category(), "connect");
    }
    const int one = 1;
    ::setsockopt(m_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    m_local = socket_address(m_fd, false).value_or(EndPointAddress{});
  }
  ~RawPeer() { close(); }
  RawPeer(const RawPeer&) = delete;
  RawPeer& operator=(const RawPeer&) = delete;
  RawPeer(RawPeer&&) = delete;
  RawPeer& operator=(RawPeer&&) = delete;

  // The address the server sees for this peer.
  [[nodiscard]] const EndPointAddress& local() const { return m_local; }
  [[nodiscard]] int fd() const { return m_fd; }

  // Sends everything; false when the server closed the connection first (or on timeout).
  bool send_all(std::span<const std::uint8_t> bytes, std::chrono::milliseconds timeout = PROMPT) {
    const auto deadline = Clock::now() + timeout;
    while (!bytes.empty()) {
      const ssize_t n = ::send(m_fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        bytes = bytes.subspan(static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd p{m_fd, POLLOUT, 0};
        if (::poll(&p, 1, static_cast<int>(remaining(deadline).count())) <= 0) return false;
        continue;
      }
      return false;
    }
    return true;
  }

  // One send() per byte.
  bool send_bytewise(std::span<const std::uint8_t> bytes) {
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      if (!send_all(bytes.subspan(i, 1))) return false;
    }
    return true;
  }

  std::optional<Bytes> read_exact(std::size_t n, std::chrono::milliseconds timeout = PROMPT) {
    const auto deadline = Clock::now() + timeout;
    Bytes out(n);
    std::size_t have = 0;
    while (have < n) {
      pollfd p{m_fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(remaining(deadline).count())) <= 0) return {};
      const ssize_t got = ::recv(m_fd, out.data() + have, n - have, MSG_DONTWAIT);
      if (got > 0) {
        have += static_cast<std::size_t>(got);
      } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
        return {};
      }
    }
    return out;
  }

  // Reads (and discards) until the server closes the connection, or the timeout.
  Outcome wait_closed(std::chrono::milliseconds timeout = PROMPT) {
    const auto deadline = Clock::now() + timeout;
    std::array<std::uint8_t, 4096> sink{};
    while (true) {
      pollfd p{m_fd, POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(remaining(deadline).count()));
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return Outcome::STILL_OPEN;
      const ssize_t got = ::recv(m_fd, sink.data(), sink.size(), MSG_DONTWAIT);
      if (got == 0) return Outcome::CLOSED;
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (got < 0) return Outcome::RESET;
    }
  }

  // True while the server has not closed its end (checked without blocking).
  [[nodiscard]] bool open_now() const {
    std::uint8_t byte = 0;
    const ssize_t got = ::recv(m_fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return got > 0 || (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
  }

  // Bytes sent but not yet acknowledged by the server's kernel.
  [[nodiscard]] int unacked() const {
    int n = 0;
    return ::ioctl(m_fd, SIOCOUTQ, &n) == 0 ? n : 0;
  }

  // Abortive close: SO_LINGER {1, 0} makes close() send a RST.
  void reset() {
    if (m_fd < 0) return;
    const linger l{1, 0};
    ::setsockopt(m_fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    close();
  }

  void close() {
    if (m_fd >= 0) ::close(m_fd);
    m_fd = -1;
  }

 private:
  int m_fd{-1};
  EndPointAddress m_local;
};

// ---- the legitimate side ----------------------------------------------------------------

inline ConnectionParameters client_params(bool session = false) {
  ConnectionParameters p{};
  p.delivery.session.enabled = session;
  p.recv_params = {.buf_size = 64 * 1024, .num_buf = 4, .use_shared_receive_buffers = false};
  p.send_buffered_params = {.buf_size = 8 * 1024, .num_buf = 4};
  return p;
}

inline ConnectionParameters listen_params() {
  ConnectionParameters p{};
  p.recv_params = {.buf_size = 64 * 1024, .num_buf = 8, .use_shared_receive_buffers = false};
  return p;
}

// A netio3 client backend on the shared loop with one connection to the listener.
// Completions are counted, not recorded, so that a long stream does not grow memory.
class LegitClient {
 public:
  LegitClient(const std::shared_ptr<netio3::EpollEventLoop>& loop, EndPointAddress server,
              BackendType type = BackendType::ASYNCMSG, NetworkMode mode = NetworkMode::TCP,
              std::string partition_key = {}, bool session = false)
      : m_server{std::move(server)}, m_session{session} {
    auto config = m_rec.config(netio3::ThreadSafetyModel::SAFE, mode);
    config.partition_key = std::move(partition_key);
    config.on_send_completed_cb = [this](const EndPointAddress&, std::uint64_t key) {
      {
        const std::lock_guard lock{m_mutex};
        ++m_completed;
        if (key < 0x1'0000'0000ULL) m_small_keys.insert(key);  // test keys, not stream keys
      }
      m_cv.notify_all();
    };
    m_backend = netio3::Netio3Backend::create(type, std::move(config), loop);
  }

  [[nodiscard]] bool connect() {
    m_backend->open_active_endpoint(m_server, client_params(m_session));
    return m_rec.wait([&](const Recorder& r) {
      return r.count(Recorder::Kind::ESTABLISHED, m_server) > 0 ||
             r.count(Recorder::Kind::REFUSED, m_server) > 0;
    }) && m_rec.snapshot().back().kind == Recorder::Kind::ESTABLISHED;
  }

  // Even sequence numbers travel with the 8-byte prefix as header_data, odd ones as one
  // span: both paths must arrive as one contiguous message.
  NetioStatus send(std::uint32_t stream, std::uint32_t seq, std::size_t size) {
    const Bytes m = make_message(stream, seq, size);
    const std::span<const std::uint8_t> all{m};
    if (seq % 2 == 0) {
      return m_backend->send_data_copy(m_server, all.subspan(PREFIX), all.first(PREFIX),
                                       message_key(stream, seq));
    }
    return m_backend->send_data_copy(m_server, all, {}, message_key(stream, seq));
  }

  // Waits for a completion beyond `seen` (after NO_RESOURCES).
  bool wait_completion_after(std::uint64_t seen, std::chrono::milliseconds timeout) {
    std::unique_lock lock{m_mutex};
    return m_cv.wait_for(lock, timeout, [&] { return m_completed > seen; });
  }
  [[nodiscard]] std::uint64_t completed() const {
    const std::lock_guard lock{m_mutex};
    return m_completed;
  }

  // Whether a completion reported `key` (only keys below 2^32, i.e. not stream keys).
  [[nodiscard]] bool saw_key(std::uint64_t key) const {
    const std::lock_guard lock{m_mutex};
    return m_small_keys.contains(key);
  }

  [[nodiscard]] NetworkBackend& backend() { return *m_backend; }
  [[nodiscard]] Recorder& recorder() { return m_rec; }
  [[nodiscard]] const EndPointAddress& server() const { return m_server; }

 private:
  EndPointAddress m_server;
  bool m_session;
  Recorder m_rec;
  mutable std::mutex m_mutex;
  std::condition_variable m_cv;
  std::uint64_t m_completed{0};
  std::set<std::uint64_t> m_small_keys;
  std::unique_ptr<NetworkBackend> m_backend;  // last: destroyed first
};

// Streams messages of varied sizes (a large one now and then) from its own thread, keeping
// at most WINDOW messages in flight, until finish().
class StreamSender {
 public:
  static constexpr std::uint32_t WINDOW = 64;

  StreamSender(LegitClient& client, StreamChecker& checker, std::uint32_t stream,
               std::size_t max_size)
      : m_client{client},
        m_checker{checker},
        m_stream{stream},
        m_max_size{max_size},
        m_thread{[this] { run(); }} {}
  ~StreamSender() { stop(0); }
  StreamSender(const StreamSender&) = delete;
  StreamSender& operator=(const StreamSender&) = delete;
  StreamSender(StreamSender&&) = delete;
  StreamSender& operator=(StreamSender&&) = delete;

  [[nodiscard]] std::size_t size_for(std::uint32_t seq) const {
    std::size_t size = PREFIX + (seq * 2654435761U >> 7U) % 3000;
    if (seq % 97 == 13) size = 150'000;  // takes the decoder's large-message path
    return std::min(size, m_max_size);
  }

  // Sends `more` further messages, stops, and returns how many were sent in all.
  std::uint32_t stop(std::uint32_t more) {
    if (m_thread.joinable()) {
      m_stop_at.store(m_sent.load() + more);
      m_stop.store(true);
      m_thread.join();
    }
    return m_sent.load();
  }

  [[nodiscard]] std::uint32_t sent() const { return m_sent.load(); }
  [[nodiscard]] std::string failure() const {
    const std::lock_guard lock{m_mutex};
    return m_failure;
  }

 private:
  void fail(std::string why) {
    const std::lock_guard lock{m_mutex};
    m_failure = std::move(why);
  }

  void run() {
    while (true) {
      const std::uint32_t seq = m_sent.load();
      if (m_stop.load() && seq >= m_stop_at.load()) return;
      if (seq >= WINDOW && !m_checker.wait_received(m_stream, seq - WINDOW, 30s)) {
        fail(fmt::format("stream {} stalled at seq {}", m_stream, seq));
        return;
      }
      if (!m_checker.errors().empty()) {
        fail("the receiver saw a broken message; stopped sending");
        return;
      }
      const auto deadline = Clock::now() + 30s;
      while (true) {
        const std::uint64_t seen = m_client.completed();
        const NetioStatus status = m_client.send(m_stream, seq, size_for(seq));
        if (status == NetioStatus::OK) break;
        if (status == NetioStatus::FAILED || Clock::now() > deadline) {
          fail(fmt::format("stream {} seq {}: send returned {}", m_stream, seq,
                           netio3::to_string(status)));
          return;
        }
        (void)m_client.wait_completion_after(seen, 100ms);  // NO_RESOURCES: retry
      }
      m_sent.store(seq + 1);
    }
  }

  LegitClient& m_client;
  StreamChecker& m_checker;
  const std::uint32_t m_stream;
  const std::size_t m_max_size;
  std::atomic<std::uint32_t> m_sent{0};
  std::atomic<bool> m_stop{false};
  std::atomic<std::uint32_t> m_stop_at{0};
  mutable std::mutex m_mutex;
  std::string m_failure;
  std::thread m_thread;  // last: starts after everything above exists
};

// ---- the fixture ------------------------------------------------------------------------

constexpr std::uint32_t LEGIT_STREAM = 1;

inline NetworkLimits patient_limits() {
  NetworkLimits limits{};
  limits.connect_timeout = PATIENT_CONNECT_TIMEOUT;
  return limits;
}

// One listener of one backend type under attack. A derived fixture says which backend and
// network mode (set_target) before start().
class HostileListener : public ::testing::Test {
 protected:
  void set_target(BackendType type, NetworkMode mode) {
    m_type = type;
    m_mode = mode;
  }

  void SetUp() override {
    if (!netio3::Netio3Backend::is_available(m_type)) {
      GTEST_SKIP() << netio3::to_string(m_type) << " backend not built";
    }
  }

  // Server backend + listener, legitimate client connected and streaming. Fatal failures
  // here abort the test (call through ASSERT_NO_FATAL_FAILURE).
  void start(NetworkLimits limits = patient_limits(), std::size_t legit_max = 200'000) {
    // With reasons: a hostile connection that was established ends as a protocol error.
    auto config = m_server_rec.config(netio3::ThreadSafetyModel::SAFE, m_mode,
                                      Recorder::Callbacks::WITH_SENDER_AND_REASON);
    config.on_data_from_cb = {};
    config.on_data_cb = [this](std::span<const std::uint8_t> data) { m_checker.on_message(data); };
    config.limits = limits;
    config.partition_key = m_partition_key;
    m_server = netio3::Netio3Backend::create(m_type, std::move(config), loop());
    m_listen = m_server->open_listen_endpoint({"127.0.0.1", 0}, listen_params());
    ASSERT_NE(m_listen.port, 0);

    m_checker.expect_stream(LEGIT_STREAM);
    m_client =
        std::make_unique<LegitClient>(loop(), m_listen, m_type, m_mode, m_partition_key, m_session);
    ASSERT_TRUE(m_client->connect()) << m_logs.dump();
    ASSERT_TRUE(m_server_rec.wait(
        [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
    m_legit_remote = m_server_rec.snapshot().front().remote;
    m_sender = std::make_unique<StreamSender>(*m_client, m_checker, LEGIT_STREAM, legit_max);
    ASSERT_TRUE(m_checker.wait_received(LEGIT_STREAM, 50, PROMPT)) << "legit stream not flowing";
    m_fd_baseline = netio3::test::open_fd_count();
  }

  [[nodiscard]] const std::shared_ptr<netio3::EpollEventLoop>& loop() const {
    return m_loop.loop();
  }

  // The legitimate stream is still flowing: `n` more messages arrive.
  void expect_stream_progress(std::uint32_t n) {
    const std::uint32_t now = m_checker.received(LEGIT_STREAM);
    EXPECT_TRUE(m_checker.wait_received(LEGIT_STREAM, now + n, PROMPT))
        << "legitimate stream stalled at " << now << m_logs.dump();
  }

  // The hostile connection was closed by the server, with a logged reason.
  void expect_dropped(RawPeer& peer, std::vector<std::string> reasons) {
    const auto outcome = peer.wait_closed(PROMPT);
    EXPECT_NE(outcome, RawPeer::Outcome::STILL_OPEN)
        << "listener kept the hostile connection from " << peer.local() << " open" << m_logs.dump();
    EXPECT_TRUE(m_logs.wait_line(peer.local(), reasons))
        << "no log line names " << peer.local() << " with reason '" << reasons.front() << "'"
        << m_logs.dump();
  }

  bool wait_server_event(Recorder::Kind kind, const EndPointAddress& remote, std::size_t n = 1) {
    return m_server_rec.wait([&](const Recorder& r) { return r.count(kind, remote) >= n; }, PROMPT);
  }

  // The reason the server's closed callback gave for `remote` (its last end).
  [[nodiscard]] std::optional<netio3::CloseReason> server_close_reason(
      const EndPointAddress& remote) {
    std::optional<netio3::CloseReason> reason;
    for (const auto& e : m_server_rec.snapshot()) {
      if (e.kind == Recorder::Kind::CLOSED && e.remote == remote) reason = e.closed;
    }
    return reason;
  }

  [[nodiscard]] std::size_t server_events(Recorder::Kind kind, const EndPointAddress& remote) {
    std::size_t n = 0;
    for (const auto& e : m_server_rec.snapshot()) n += (e.kind == kind && e.remote == remote);
    return n;
  }

  // Waits until the server has read and processed every byte `peer` sent, or holds the
  // rest of a large message body below its wake threshold (asyncmsg sets SO_RCVLOWAT to what
  // that body still needs: those bytes are read when the rest has come, or the peer ends).
  void wait_consumed(const RawPeer& peer) {
    const int server_fd = server_socket_for(m_listen, peer.local());
    ASSERT_GE(server_fd, 0) << "server socket for " << peer.local() << " not found";
    EXPECT_TRUE(netio3::test::eventually(
        [&] {
          int queued = 0;
          if (::ioctl(server_fd, SIOCINQ, &queued) != 0) return true;  // already closed
          const int threshold = rcvlowat_of(server_fd);
          if (threshold < 0) return true;  // already closed
          return peer.unacked() == 0 && (queued == 0 || queued < threshold);
        },
        PROMPT));
    loop()->run_sync([] {});  // the callback that read the last bytes has returned
  }

  // The server socket's SO_RCVLOWAT for `peer` (asyncmsg's wake threshold); -1 if none.
  int server_wake_threshold(const RawPeer& peer) {
    return rcvlowat_of(server_socket_for(m_listen, peer.local()));
  }

  // A socket's SO_RCVLOWAT; -1 if there is no such socket.
  static int rcvlowat_of(int fd) {
    int threshold = -1;
    socklen_t len = sizeof threshold;
    if (fd < 0 || ::getsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &threshold, &len) != 0) return -1;
    return threshold;
  }

  // The end of every test: the legitimate stream delivered everything intact and in order,
  // its connection survived, the listener still accepts and serves a new client, and every
  // descriptor the attack created is gone.
  void finish() {
    const std::uint32_t sent = m_sender->stop(100);
    EXPECT_EQ(m_sender->failure(), "");
    EXPECT_TRUE(m_checker.wait_received(LEGIT_STREAM, sent, PROMPT))
        << "delivered " << m_checker.received(LEGIT_STREAM) << " of " << sent;
    EXPECT_EQ(m_checker.received(LEGIT_STREAM), sent);
    EXPECT_EQ(m_checker.errors(), std::vector<std::string>{});
    EXPECT_EQ(server_events(Recorder::Kind::CLOSED, m_legit_remote), 0U)
        << "the legitimate connection was closed";
    EXPECT_EQ(m_client->recorder().snapshot().size(), 1U)
        << "the legitimate client saw more than its ESTABLISHED";
    std::printf("[ info     ] legitimate stream: %u messages delivered in order\n", sent);

    {  // the listener keeps working
      const std::uint32_t stream = m_next_stream++;
      m_checker.expect_stream(stream);
      LegitClient fresh{loop(), m_listen, m_type, m_mode, m_partition_key, m_session};
      EXPECT_TRUE(fresh.connect()) << "listener no longer accepts" << m_logs.dump();
      for (std::uint32_t seq = 0; seq < 20; ++seq) {
        EXPECT_EQ(fresh.send(stream, seq, PREFIX + seq * 100), NetioStatus::OK);
      }
      EXPECT_TRUE(m_checker.wait_received(stream, 20, PROMPT)) << m_logs.dump();
    }

    const bool back = netio3::test::eventually(
        [&] { return netio3::test::open_fd_count() <= m_fd_baseline; }, PROMPT);
    if (!m_check_fds) {
      std::printf("[ info     ] fds: baseline %zu, after the attack %zu (not checked: %s)\n",
                  m_fd_baseline, netio3::test::open_fd_count(), m_why_fds_unchecked.c_str());
      return;
    }
    EXPECT_TRUE(back) << "open fds: " << netio3::test::open_fd_count() << ", baseline "
                      << m_fd_baseline;
    std::printf("[ info     ] fds: baseline %zu, after the attack %zu\n", m_fd_baseline,
                netio3::test::open_fd_count());
  }

  std::uint32_t new_stream() {
    const std::uint32_t stream = m_next_stream++;
    m_checker.expect_stream(stream);
    return stream;
  }

  BackendType m_type{BackendType::ASYNCMSG};
  NetworkMode m_mode{NetworkMode::TCP};
  // Admission (docs/admission.md): the server and the legitimate clients hold this key.
  std::string m_partition_key;
  bool m_session{false};  // the legitimate clients' connections have a session (asyncmsg)
  // Declared first: destroyed last, after the backends stopped logging.
  LogCapture m_logs;
  StreamChecker m_checker;
  Recorder m_server_rec;
  netio3::test::LoopThread m_loop;
  std::unique_ptr<NetworkBackend> m_server;
  EndPointAddress m_listen;
  EndPointAddress m_legit_remote;
  std::unique_ptr<LegitClient> m_client;
  std::unique_ptr<StreamSender> m_sender;
  std::size_t m_fd_baseline{0};
  // finish() checks that the descriptors came back to the baseline, unless a test says why not.
  bool m_check_fds{true};
  std::string m_why_fds_unchecked;
  std::uint32_t m_next_stream{100};
};

inline Bytes random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng{seed};
  Bytes out(n);
  for (auto& b : out) b = static_cast<std::uint8_t>(rng() & 0xFFU);
  return out;
}

// Sets RLIMIT_NOFILE's soft limit for the scope.
class FdLimit {
 public:
  explicit FdLimit(rlim_t soft) {
    ::getrlimit(RLIMIT_NOFILE, &m_saved);
    rlimit lowered = m_saved;
    lowered.rlim_cur = soft;
    m_ok = ::setrlimit(RLIMIT_NOFILE, &lowered) == 0;
  }
  ~FdLimit() { restore(); }
  FdLimit(const FdLimit&) = delete;
  FdLimit& operator=(const FdLimit&) = delete;
  FdLimit(FdLimit&&) = delete;
  FdLimit& operator=(FdLimit&&) = delete;
  void restore() {
    if (m_ok) ::setrlimit(RLIMIT_NOFILE, &m_saved);
    m_ok = false;
  }
  [[nodiscard]] bool ok() const { return m_ok; }

 private:
  rlimit m_saved{};
  bool m_ok{false};
};

// The RLIMIT_NOFILE value below which exactly `room` descriptor numbers are free (new
// descriptors take the lowest free number; open ones above the limit stay valid).
inline rlim_t limit_leaving_room(int room) {
  std::set<int> open;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  const int own = ::dirfd(dir);
  while (const dirent* entry = ::readdir(dir)) {
    const int fd = entry->d_name[0] == '.' ? -1 : std::atoi(entry->d_name);
    if (fd >= 0 && fd != own) open.insert(fd);
  }
  ::closedir(dir);
  int n = 0;
  for (int free = 0; free < room; ++n) free += open.contains(n) ? 0 : 1;
  return static_cast<rlim_t>(n);
}

}  // namespace netio3::hostile
