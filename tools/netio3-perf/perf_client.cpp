#include "perf_client.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <iostream>
#include <mutex>
#include <sys/mman.h>
#include <thread>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include "perf_server.hpp"  // process_cpu_ns, now_ns

namespace netio3::perf {

std::string_view to_string(SendKind kind) {
  switch (kind) {
    case SendKind::BUFFERED:
      return "buffered";
    case SendKind::ZERO_COPY:
      return "zero-copy";
    case SendKind::COPY:
      return "copy";
  }
  return "?";
}

std::optional<SendKind> parse_send_kind(std::string_view text) {
  for (const auto kind : {SendKind::BUFFERED, SendKind::ZERO_COPY, SendKind::COPY}) {
    if (text == to_string(kind)) return kind;
  }
  if (text == "zerocopy") return SendKind::ZERO_COPY;
  return std::nullopt;
}

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t CONTROL_KEY = std::uint64_t{1} << 63U;
constexpr auto SETUP_TIMEOUT = 10s;
constexpr auto STALL_TIMEOUT = 10s;
constexpr auto CLOSE_TIMEOUT = 5s;
constexpr std::size_t NO_CONN = ~std::size_t{0};

// Buffers (or zero-copy slots) per connection when --window is not given: about 2 MiB in
// flight, at least 8 messages, at most 1024. More bytes in flight only add cache misses:
// on the 2-core test machine 32 MiB in flight (the earlier default) gave 0.45-0.6x the
// rate at 64 KiB for UCX and asyncmsg, and 0.5-0.8x at 1 MiB for libfabric
// (docs/benchmarks.md). netio3-raw-fabric takes the same default (capped at 64).
std::size_t auto_window(std::size_t size) {
  return std::clamp<std::size_t>((std::size_t{2} << 20U) / std::max<std::size_t>(size, 1), 8, 1024);
}

// Puts a message's payload at `where`: all of it, or (LIGHT verification, which reads the
// first and the last byte) just those two bytes, as an application that fills its data in
// place would.
void place_payload(std::uint8_t* where, std::span<const std::uint8_t> payload, bool whole) {
  if (payload.empty()) return;
  if (whole) {
    std::memcpy(where, payload.data(), payload.size());
    return;
  }
  where[0] = payload.front();
  where[payload.size() - 1] = payload.back();
}

struct AlignedFree {
  void operator()(std::uint8_t* p) const noexcept { std::free(p); }
};

struct Conn {
  EndPointAddress address;
  std::size_t index{0};
  std::size_t sender{0};
  // Set-up and end (under Run::m_mutex).
  std::uint32_t token{0};
  bool established{false};
  std::chrono::steady_clock::time_point opened{};
  std::chrono::steady_clock::time_point established_at{};
  bool hello{false};
  bool refused{false};
  bool closed{false};
  bool report{false};
  std::uint64_t report_seq{0};
  ReportBody report_body{};
  // Sending side: written by the one thread that sends on this connection.
  std::uint64_t next_seq{0};
  std::atomic<std::uint64_t> submitted{0};  // sends accepted, data and control
  std::atomic<std::uint64_t> data_sent{0};
  NetworkBuffer* held{nullptr};  // buffered: filled, refused by send_buffer, to retry
  // Completion side (loop thread).
  std::atomic<std::uint64_t> completions{0};
  std::unique_ptr<std::uint8_t[], AlignedFree> region;  // zero-copy: window + 1 slots
  std::unique_ptr<std::atomic<bool>[]> slot_busy;
  // Latency (loop thread).
  std::uint64_t ping_sent_ns{0};
  bool ping_pending{false};
  bool ping_done{false};
};

struct Sender {
  std::vector<Conn*> conns;
  std::atomic<std::uint64_t> progress{0};
  std::atomic<bool> waiting{false};
  std::mutex mutex;
  std::condition_variable cv;
};

class Run {
 public:
  Run(const ClientOptions& options, const EndPointAddress& server);
  ~Run();
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;
  Run(Run&&) = delete;
  Run& operator=(Run&&) = delete;

  RunResult execute();

 private:
  // Callbacks (loop thread).
  void on_established(const EndPointAddress& remote);
  void on_refused(const EndPointAddress& remote, const RefusalReason& reason);
  void on_closed(const EndPointAddress& remote, const std::vector<std::uint64_t>& keys);
  void on_completed(const EndPointAddress& remote, std::uint64_t key);
  void on_data(std::span<const std::uint8_t> data);
  void on_pong(Conn& c, const Header& h, std::span<const std::uint8_t> data);
  void on_ready(const EndPointAddress& remote);

  // Runs f where the thread-safety model allows API calls.
  template <typename F>
  auto api(F&& f) {
    if (m_options.threads > 0) return f();
    using R = std::invoke_result_t<F>;
    if constexpr (std::is_void_v<R>) {
      m_loop->run_sync(std::forward<F>(f));
    } else {
      std::optional<R> result;
      m_loop->run_sync([&] { result.emplace(f()); });
      return std::move(*result);
    }
  }

  Conn* conn_of(const EndPointAddress& remote) const;
  Conn* conn_of_token(std::uint32_t token) const;
  ConnectionParameters params_for(Conn& c);
  NetioStatus send_message(Conn& c, const Header& h, std::span<const std::uint8_t> rest,
                           bool control);
  NetioStatus send_data(Conn& c);
  void send_ping(Conn& c);
  void send_control(Conn& c, const Header& h, std::span<const std::uint8_t> body);
  void connect(Conn& c);
  bool pump();
  void send_until_refused(Conn& c);
  void sender_thread(Sender& s);
  void fail(const std::string& why);
  bool wait(const std::function<bool()>& pred, std::chrono::nanoseconds timeout);
  [[nodiscard]] bool failed();
  [[nodiscard]] std::string failure();
  void progress_thread(const std::stop_token& stop);

  ClientOptions m_options;
  EndPointAddress m_server;
  std::size_t m_window;
  std::size_t m_slot;  // zero-copy slot size
  // Zero-copy data slots (the control message's slot follows them): one with --same-buffer.
  [[nodiscard]] std::size_t data_slots() const { return m_options.same_buffer ? 1 : m_window; }
  Pattern m_pattern;
  std::shared_ptr<EpollEventLoop> m_loop;
  std::jthread m_loop_thread;
  std::unique_ptr<NetworkBackend> m_backend;

  std::vector<std::unique_ptr<Conn>> m_conns;
  std::unique_ptr<std::atomic<std::size_t>[]> m_by_port;      // port -> connection index
  std::unordered_map<std::uint32_t, std::size_t> m_by_token;  // under m_mutex, loop thread
  std::vector<std::unique_ptr<Sender>> m_senders;

  std::mutex m_mutex;
  std::condition_variable m_cv;
  std::size_t m_pending{NO_CONN};  // the connection waiting for its HELLO
  std::vector<std::uint16_t> m_ports;
  bool m_ports_received{false};
  std::string m_failure;
  std::size_t m_reports{0};
  std::size_t m_pings_done{0};
  std::atomic<bool> m_main_waits{false};  // completions notify m_cv
  std::uint64_t m_end_ns{0};

  std::atomic<bool> m_sending{false};
  std::uint64_t m_deadline_ns{0};
  Clock::time_point m_deadline;
  PrepareHookHandle m_pump;
  std::vector<std::uint64_t> m_rtt_ns;  // loop thread
  std::uint64_t m_pong_errors{0};       // loop thread
  std::atomic<bool> m_stop_senders{false};
  std::uint64_t m_ready_callbacks{0};  // loop thread
};

Run::Run(const ClientOptions& options, const EndPointAddress& server)
    : m_options{options},
      m_server{server},
      m_window{options.window != 0 ? options.window : auto_window(options.size)},
      m_slot{(std::max(options.size, CONTROL_SIZE) + 63) / 64 * 64},
      m_pattern{options.size - HEADER_SIZE},
      m_loop{make_loop(options.busy_poll)},
      m_by_port{std::make_unique<std::atomic<std::size_t>[]>(65536)} {
  for (std::size_t p = 0; p < 65536; ++p) m_by_port[p].store(NO_CONN, std::memory_order_relaxed);
  NetworkConfig config{
      .mode = options.mode,
      .thread_safety = options.threads > 0 ? ThreadSafetyModel::SAFE : ThreadSafetyModel::UNSAFE};
  config.on_data_cb = [this](std::span<const std::uint8_t> data) { on_data(data); };
  config.on_connection_established_cb = [this](const EndPointAddress& remote,
                                               EndpointCapabilities) { on_established(remote); };
  config.on_connection_refused_reason_cb = [this](const EndPointAddress& remote,
                                                  const RefusalReason& reason) {
    on_refused(remote, reason);
  };
  config.on_connection_closed_cb = [this](const EndPointAddress& remote,
                                          const std::vector<std::uint64_t>& keys) {
    on_closed(remote, keys);
  };
  config.on_send_completed_cb = [this](const EndPointAddress& remote, std::uint64_t key) {
    on_completed(remote, key);
  };
  if (options.on_ready) {
    config.on_ready_to_send_cb = [this](const EndPointAddress& remote) { on_ready(remote); };
  }
  config.limits.max_message_size = std::max(options.size, CONTROL_SIZE);
  config.partition_key = options.partition_key;
  m_backend = Netio3Backend::create(options.backend, std::move(config), m_loop);
  m_loop_thread = std::jthread{[loop = m_loop] { loop->run(); }};
  // run_sync() runs inline while the loop is not running yet: wait until it dispatches, so
  // that UNSAFE calls made through it really run on the loop thread.
  std::promise<void> running;
  auto started = running.get_future();
  m_loop->post([&running] { running.set_value(); });
  if (started.wait_for(SETUP_TIMEOUT) != std::future_status::ready) {
    throw std::runtime_error("netio3-perf: the event loop did not start");
  }
}

Run::~Run() {
  m_stop_senders = true;
  for (auto& s : m_senders) {
    const std::lock_guard lock{s->mutex};
    s->cv.notify_all();
  }
  if (m_loop_thread.joinable()) m_loop->run_sync([this] { m_pump.close(); });
  m_backend.reset();
  m_loop->stop();
  if (m_loop_thread.joinable()) m_loop_thread.join();
}

void Run::fail(const std::string& why) {
  {
    const std::lock_guard lock{m_mutex};
    if (m_failure.empty()) m_failure = why;
  }
  m_sending = false;
  m_stop_senders = true;
  m_cv.notify_all();
  for (auto& s : m_senders) {
    const std::lock_guard lock{s->mutex};
    s->cv.notify_all();
  }
}

bool Run::failed() {
  const std::lock_guard lock{m_mutex};
  return !m_failure.empty();
}

std::string Run::failure() {
  const std::lock_guard lock{m_mutex};
  return m_failure;
}

bool Run::wait(const std::function<bool()>& pred, std::chrono::nanoseconds timeout) {
  std::unique_lock lock{m_mutex};
  return m_cv.wait_for(lock, timeout, [&] { return !m_failure.empty() || pred(); }) &&
         m_failure.empty();
}

Conn* Run::conn_of(const EndPointAddress& remote) const {
  const std::size_t index = m_by_port[remote.port].load(std::memory_order_acquire);
  return index == NO_CONN ? nullptr : m_conns[index].get();
}

Conn* Run::conn_of_token(std::uint32_t token) const {
  const auto it = m_by_token.find(token);
  return it == m_by_token.end() ? nullptr : m_conns[it->second].get();
}

// ---------------------------------------------------------------------------------------
// Callbacks

void Run::on_established(const EndPointAddress& remote) {
  Conn* c = conn_of(remote);
  if (c == nullptr) return;
  const std::lock_guard lock{m_mutex};
  c->established = true;
  c->established_at = std::chrono::steady_clock::now();
  m_cv.notify_all();
}

void Run::on_refused(const EndPointAddress& remote, const RefusalReason& reason) {
  Conn* c = conn_of(remote);
  if (c == nullptr) return;
  {
    const std::lock_guard lock{m_mutex};
    c->refused = true;
  }
  fail(fmt::format("connection to {} refused ({}): {}", remote, reason.cause, reason.message));
}

void Run::on_closed(const EndPointAddress& remote, const std::vector<std::uint64_t>& keys) {
  Conn* c = conn_of(remote);
  if (c == nullptr) return;
  bool expected = false;
  {
    const std::lock_guard lock{m_mutex};
    c->closed = true;
    expected = c->report;  // closed by us after the run
    m_cv.notify_all();
  }
  if (!expected) {
    fail(fmt::format("connection to {} closed during the run ({} sends cancelled)", remote,
                     keys.size()));
  }
}

// --on-ready: the connection takes sends again; the only place sending goes on.
void Run::on_ready(const EndPointAddress& remote) {
  ++m_ready_callbacks;
  Conn* c = conn_of(remote);
  if (c != nullptr && m_sending.load(std::memory_order_relaxed)) send_until_refused(*c);
}

void Run::on_completed(const EndPointAddress& remote, std::uint64_t key) {
  Conn* c = conn_of(remote);
  if (c == nullptr) return;
  if (m_options.send == SendKind::ZERO_COPY) {
    const bool control = (key & CONTROL_KEY) != 0;
    if (control || !m_options.same_buffer) {
      c->slot_busy[control ? data_slots() : key % m_window].store(false, std::memory_order_release);
    }
  }
  c->completions.fetch_add(1);
  if (m_options.threads > 0) {
    Sender& s = *m_senders[c->sender];
    s.progress.fetch_add(1);
    if (s.waiting.load()) {
      const std::lock_guard lock{s.mutex};
      s.cv.notify_one();
    }
  }
  if (c->ping_pending) send_ping(*c);
  // Only while the main thread waits for completions (control messages, the drain); the
  // counter above is seq_cst, so either it sees the new count or this sees it waiting.
  if (m_main_waits.load()) {
    { const std::lock_guard lock{m_mutex}; }
    m_cv.notify_all();
  }
}

void Run::on_data(std::span<const std::uint8_t> data) {
  const auto h = decode(data);
  if (!h) {
    fail(fmt::format("a message of {} B that is not netio3-perf's", data.size()));
    return;
  }
  if (h->type == Type::PONG) {
    Conn* c = conn_of_token(h->token);
    if (c == nullptr) {
      fail("a PONG for an unknown connection");
      return;
    }
    on_pong(*c, *h, data);
    return;
  }
  std::unique_lock lock{m_mutex};
  switch (h->type) {
    case Type::HELLO: {
      if (m_pending == NO_CONN) {
        lock.unlock();
        fail("a HELLO nobody waited for");
        return;
      }
      Conn& c = *m_conns[m_pending];
      c.token = h->token;
      c.hello = true;
      m_by_token[h->token] = m_pending;
      m_pending = NO_CONN;
      break;
    }
    case Type::PORTS: {
      const std::size_t n = h->seq;
      if (n > MAX_CONNECTIONS || data.size() != HEADER_SIZE + 2 * n) {
        lock.unlock();
        fail("a malformed PORTS message");
        return;
      }
      m_ports.resize(n);
      std::memcpy(m_ports.data(), data.data() + HEADER_SIZE, 2 * n);
      m_ports_received = true;
      break;
    }
    case Type::REPORT: {
      Conn* c = conn_of_token(h->token);
      const auto report = body<ReportBody>(data);
      if (c == nullptr || !report || c->report) {
        lock.unlock();
        fail("an unexpected REPORT");
        return;
      }
      c->report = true;
      c->report_seq = h->seq;
      c->report_body = *report;
      if (++m_reports == m_conns.size()) m_end_ns = now_ns();
      break;
    }
    default:
      lock.unlock();
      fail(fmt::format("an unexpected message of type {}", static_cast<unsigned>(h->type)));
      return;
  }
  m_cv.notify_all();
}

void Run::on_pong(Conn& c, const Header& h, std::span<const std::uint8_t> data) {
  const std::uint64_t now = now_ns();
  if (h.seq + 1 != c.next_seq || data.size() != m_options.size ||
      !m_pattern.check(h.seq, data.subspan(HEADER_SIZE), m_options.verify)) {
    ++m_pong_errors;
  }
  m_rtt_ns.push_back(now - c.ping_sent_ns);
  if (now < m_deadline_ns && m_sending.load(std::memory_order_relaxed)) {
    send_ping(c);
    return;
  }
  c.ping_done = true;
  {
    const std::lock_guard lock{m_mutex};
    ++m_pings_done;
  }
  m_cv.notify_all();
}

// ---------------------------------------------------------------------------------------
// Sending

NetioStatus Run::send_message(Conn& c, const Header& h, std::span<const std::uint8_t> rest,
                              bool control) {
  std::array<std::uint8_t, HEADER_SIZE> header{};
  encode(h, header);
  NetioStatus status = NetioStatus::FAILED;
  switch (m_options.send) {
    case SendKind::BUFFERED: {
      NetworkBuffer* buffer = std::exchange(c.held, nullptr);
      if (buffer == nullptr) {
        buffer = m_backend->get_buffer(c.address);
        if (buffer == nullptr) return NetioStatus::NO_RESOURCES;
      } else {
        buffer->clear();
      }
      buffer->write(header);
      std::uint8_t* where = buffer->data() + buffer->size();
      buffer->resize(buffer->size() + rest.size());
      place_payload(where, rest, control || m_options.verify == Verify::FULL);
      status = m_backend->send_buffer(c.address, buffer);
      if (status == NetioStatus::NO_RESOURCES) c.held = buffer;
      break;
    }
    case SendKind::COPY:
      status = m_backend->send_data_copy(c.address, rest, header, control ? CONTROL_KEY : h.seq);
      break;
    case SendKind::ZERO_COPY: {
      if (m_options.same_buffer && !control) {
        // The one data buffer, written in params_for; the window bounds what is in flight.
        if (c.submitted.load(std::memory_order_relaxed) - c.completions.load() >= m_window) {
          return NetioStatus::NO_RESOURCES;
        }
        status = m_backend->send_data(
            c.address, std::span<std::uint8_t>{c.region.get(), rest.size()}, header, h.seq);
        break;
      }
      const std::size_t slot = control ? data_slots() : h.seq % m_window;
      if (c.slot_busy[slot].load(std::memory_order_acquire)) return NetioStatus::NO_RESOURCES;
      std::uint8_t* where = c.region.get() + slot * m_slot;
      place_payload(where, rest, control || m_options.verify == Verify::FULL);
      c.slot_busy[slot].store(true, std::memory_order_relaxed);
      status = m_backend->send_data(c.address, std::span<std::uint8_t>{where, rest.size()}, header,
                                    control ? CONTROL_KEY : h.seq);
      if (status != NetioStatus::OK) c.slot_busy[slot].store(false, std::memory_order_relaxed);
      break;
    }
  }
  if (status == NetioStatus::OK) {
    c.submitted.store(c.submitted.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  return status;
}

NetioStatus Run::send_data(Conn& c) {
  const std::uint64_t seq = c.next_seq;
  const auto status = send_message(c, Header{.type = Type::DATA, .token = c.token, .seq = seq},
                                   m_pattern.payload(seq), false);
  if (status == NetioStatus::OK) {
    c.next_seq = seq + 1;
    c.data_sent.store(seq + 1, std::memory_order_relaxed);
  } else if (status == NetioStatus::FAILED) {
    fail(fmt::format("a send to {} failed", c.address));
  }
  return status;
}

void Run::send_ping(Conn& c) {
  const std::uint64_t seq = c.next_seq;
  c.ping_sent_ns = now_ns();
  const auto status = send_message(c, Header{.type = Type::PING, .token = c.token, .seq = seq},
                                   m_pattern.payload(seq), false);
  c.ping_pending = status == NetioStatus::NO_RESOURCES;
  if (status == NetioStatus::OK) {
    c.next_seq = seq + 1;
    c.data_sent.store(seq + 1, std::memory_order_relaxed);
  } else if (status == NetioStatus::FAILED) {
    fail(fmt::format("a ping to {} failed", c.address));
  }
}

// A control message, retried on NO_RESOURCES; returns once it and everything before it on
// this connection completed (or the run failed).
void Run::send_control(Conn& c, const Header& h, std::span<const std::uint8_t> body) {
  const auto deadline = Clock::now() + STALL_TIMEOUT;
  m_main_waits = true;
  const auto done = [this] { m_main_waits = false; };
  for (;;) {
    const std::uint64_t seen = c.completions.load();
    const auto status = api([&] { return send_message(c, h, body, true); });
    if (status == NetioStatus::OK) break;
    if (status == NetioStatus::FAILED) {
      fail(fmt::format("a control message to {} failed", c.address));
      done();
      return;
    }
    if (!wait([&] { return c.completions.load() != seen; },
              std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()))) {
      if (!failed()) fail(fmt::format("no buffer for a control message to {}", c.address));
      done();
      return;
    }
  }
  if (!wait([&] { return c.completions.load() == c.submitted.load(); }, STALL_TIMEOUT) &&
      !failed()) {
    fail(fmt::format("a control message to {} did not complete", c.address));
  }
  done();
}

ConnectionParameters Run::params_for(Conn& c) {
  ConnectionParameters params{};
  params.recv_params = {.buf_size = std::max(m_options.size, CONTROL_SIZE), .num_buf = 16};
  params.delivery.acknowledged = m_options.acknowledged;
  params.delivery.session.enabled = m_options.session;
  switch (m_options.send) {
    case SendKind::BUFFERED:
      params.send_buffered_params = {.buf_size = std::max(m_options.size, CONTROL_SIZE),
                                     .num_buf = m_window};
      break;
    case SendKind::ZERO_COPY: {
      const std::size_t bytes = (data_slots() + 1) * m_slot;
      // As docs/ucx.md advises for a zero-copy region: 2 MiB pages where it spans one.
      constexpr std::size_t HUGE_PAGE = std::size_t{2} << 20U;
      const std::size_t align = bytes >= HUGE_PAGE ? HUGE_PAGE : 4096;
      const std::size_t rounded = (bytes + align - 1) / align * align;
      c.region.reset(static_cast<std::uint8_t*>(std::aligned_alloc(align, rounded)));
      if (!c.region) throw std::bad_alloc{};
      if (align == HUGE_PAGE) (void)::madvise(c.region.get(), rounded, MADV_HUGEPAGE);
      std::memset(c.region.get(), 0, bytes);
      if (m_options.same_buffer) {
        const auto payload = m_pattern.payload(0);
        std::memcpy(c.region.get(), payload.data(), payload.size());
      }
      c.slot_busy = std::make_unique<std::atomic<bool>[]>(data_slots() + 1);
      params.send_zero_copy_params = {.buf_size = bytes, .mr_start = c.region.get()};
      break;
    }
    case SendKind::COPY:
      break;
  }
  return params;
}

void Run::connect(Conn& c) {
  const auto params = params_for(c);
  {
    const std::lock_guard lock{m_mutex};
    m_pending = c.index;
  }
  m_by_port[c.address.port].store(c.index, std::memory_order_release);
  c.opened = Clock::now();
  api([&] { m_backend->open_active_endpoint(c.address, params); });
  if (!wait([&] { return c.established && c.hello; }, SETUP_TIMEOUT) && !failed()) {
    fail(fmt::format("connection to {} not set up within {} s", c.address,
                     std::chrono::duration_cast<std::chrono::seconds>(SETUP_TIMEOUT).count()));
  }
}

// UNSAFE: sends from the loop thread, once per loop iteration, as long as the backend takes
// them. Returns whether the loop may sleep.
bool Run::pump() {
  if (!m_sending.load(std::memory_order_relaxed)) return true;
  if (Clock::now() >= m_deadline) {
    m_sending = false;
    const std::lock_guard lock{m_mutex};
    m_cv.notify_all();
    return true;
  }
  bool sent = false;
  for (auto& c : m_conns) {
    for (int n = 0; n < 4096 && send_data(*c) == NetioStatus::OK; ++n) sent = true;
  }
  return !sent;
}

void Run::send_until_refused(Conn& c) {
  while (m_sending.load(std::memory_order_relaxed) && send_data(c) == NetioStatus::OK) {
  }
}

void Run::sender_thread(Sender& s) {
  while (!m_stop_senders.load(std::memory_order_relaxed)) {
    const std::uint64_t seen = s.progress.load();
    bool sent = false;
    for (Conn* c : s.conns) {
      for (int n = 0; n < 64 && send_data(*c) == NetioStatus::OK; ++n) sent = true;
    }
    const auto now = Clock::now();
    if (now >= m_deadline) return;
    if (sent) continue;
    std::unique_lock lock{s.mutex};
    s.waiting = true;
    const bool progressed = s.cv.wait_until(lock, std::min(m_deadline, now + STALL_TIMEOUT), [&] {
      return s.progress.load() != seen || m_stop_senders.load() || Clock::now() >= m_deadline;
    });
    s.waiting = false;
    if (!progressed) {
      lock.unlock();
      fail(fmt::format("no send completed for {} s", STALL_TIMEOUT.count()));
      return;
    }
  }
}

void Run::progress_thread(const std::stop_token& stop) {
  std::mutex mutex;
  std::condition_variable_any cv;
  std::uint64_t last = 0;
  auto last_time = Clock::now();
  const auto start = last_time;
  std::unique_lock lock{mutex};
  for (;;) {
    // A periodic display, not a synchronisation: wakes every second until stopped.
    cv.wait_for(lock, stop, 1s, [] { return false; });
    if (stop.stop_requested()) break;
    std::uint64_t done = 0;
    for (const auto& c : m_conns) done += c->completions.load(std::memory_order_relaxed);
    const auto now = Clock::now();
    const double dt = std::chrono::duration<double>(now - last_time).count();
    const double rate = static_cast<double>(done - last) / dt;
    std::cerr << fmt::format("\r[{:5.1f} s] {:12.0f} msg/s {:10.1f} MB/s   ",
                             std::chrono::duration<double>(now - start).count(), rate,
                             rate * static_cast<double>(m_options.size) / 1e6)
              << std::flush;
    last = done;
    last_time = now;
  }
  std::cerr << "\r" << std::string(60, ' ') << "\r" << std::flush;
}

// ---------------------------------------------------------------------------------------

RunResult Run::execute() {
  RunResult result;
  result.window = m_window;
  const auto error = [&](std::string why) {
    result.error = std::move(why);
    return result;
  };
  // Connections: the first to the server's address, the others to listeners it opens.
  m_conns.reserve(m_options.connections);
  const auto add_conn = [&](EndPointAddress address) -> Conn& {
    auto c = std::make_unique<Conn>();
    c->address = std::move(address);
    c->index = m_conns.size();
    c->sender = m_options.threads > 0 ? c->index % m_options.threads : 0;
    if (m_options.threads > 0) m_senders[c->sender]->conns.push_back(c.get());
    m_conns.push_back(std::move(c));
    return *m_conns.back();
  };
  // Senders exist before the first connection: its completions reach them.
  for (std::size_t t = 0; t < m_options.threads; ++t) {
    m_senders.push_back(std::make_unique<Sender>());
  }
  connect(add_conn(m_server));
  if (failed()) return error(failure());
  if (m_options.connections > 1) {
    const std::uint64_t extra = m_options.connections - 1;
    send_control(*m_conns[0], Header{.type = Type::OPEN, .token = m_conns[0]->token, .seq = extra},
                 {});
    if (!wait([&] { return m_ports_received; }, SETUP_TIMEOUT)) {
      return error(failed() ? failure() : "the server did not answer OPEN");
    }
    if (m_ports.size() != extra) {
      return error(fmt::format("the server opened {} of {} listeners", m_ports.size(), extra));
    }
    for (const auto port : m_ports) {
      connect(add_conn(EndPointAddress{m_server.address, port}));
      if (failed()) return error(failure());
    }
  }
  {
    const std::lock_guard lock{m_mutex};
    double total_us = 0;
    for (const auto& c : m_conns) {
      total_us += std::chrono::duration<double, std::micro>(c->established_at - c->opened).count();
    }
    result.setup_us = total_us / static_cast<double>(m_conns.size());
  }
  // START on every connection.
  const StartBody start{.test = m_options.test,
                        .size = static_cast<std::uint32_t>(m_options.size),
                        .verify = m_options.verify};
  std::array<std::uint8_t, sizeof(StartBody)> start_bytes{};
  std::memcpy(start_bytes.data(), &start, sizeof start);
  for (auto& c : m_conns) {
    send_control(*c, Header{.type = Type::START, .token = c->token}, start_bytes);
    if (failed()) return error(failure());
  }
  if (m_options.test == Test::LATENCY) m_rtt_ns.reserve(1U << 20U);

  // The run.
  const std::uint64_t cpu0 = process_cpu_ns();
  const std::uint64_t t0 = now_ns();
  const auto duration = std::chrono::duration_cast<Clock::duration>(m_options.duration);
  m_deadline = Clock::now() + duration;
  m_deadline_ns = t0 + static_cast<std::uint64_t>(
                           std::chrono::duration_cast<std::chrono::nanoseconds>(duration).count());
  m_sending = true;
  std::jthread progress;
  if (m_options.progress)
    progress = std::jthread{[this](std::stop_token st) { progress_thread(st); }};
  std::vector<std::jthread> threads;
  if (m_options.test == Test::LATENCY) {
    m_loop->post([this] {
      for (auto& c : m_conns) send_ping(*c);
    });
    if (!wait([&] { return m_pings_done == m_conns.size(); }, duration + STALL_TIMEOUT)) {
      m_loop->run_sync([this] { m_sending = false; });
      return error(failed() ? failure() : "a ping was not answered");
    }
  } else if (m_options.on_ready) {
    // Each connection is filled once; from then on only the callback sends. This thread
    // ends the run at the deadline (waited out unless the run fails).
    m_loop->run_sync([this] {
      for (auto& c : m_conns) send_until_refused(*c);
    });
    (void)wait([] { return false; }, duration);
    m_loop->run_sync([this, &result] {
      m_sending = false;
      result.ready_callbacks = m_ready_callbacks;
    });
    if (failed()) return error(failure());
  } else if (m_options.threads == 0) {
    m_loop->run_sync([this] { m_pump = m_loop->add_prepare_hook([this] { return pump(); }); });
    if (!wait([&] { return !m_sending.load(); }, duration + STALL_TIMEOUT)) {
      m_loop->run_sync([this] { m_sending = false; });
      return error(failed() ? failure() : "the sending did not end");
    }
    m_loop->run_sync([this] { m_pump.close(); });
  } else {
    for (auto& s : m_senders) {
      threads.emplace_back([this, sender = s.get()] { sender_thread(*sender); });
    }
    threads.clear();  // joins
    m_sending = false;
  }
  if (failed()) return error(failure());
  // Everything sent must complete, then END on each connection and the server's REPORT.
  m_main_waits = true;
  const bool drained = wait(
      [&] {
        return std::all_of(m_conns.begin(), m_conns.end(), [](const auto& c) {
          return c->completions.load() == c->submitted.load();
        });
      },
      STALL_TIMEOUT);
  m_main_waits = false;
  if (!drained) return error(failed() ? failure() : "sends did not complete");
  for (auto& c : m_conns) {
    send_control(*c, Header{.type = Type::END, .token = c->token, .seq = c->data_sent.load()}, {});
    if (failed()) return error(failure());
  }
  if (!wait([&] { return m_reports == m_conns.size(); }, STALL_TIMEOUT)) {
    return error(failed() ? failure() : "the server did not report");
  }
  const std::uint64_t cpu1 = process_cpu_ns();
  progress = {};

  // Results.
  result.ok = true;
  result.intact = true;
  std::uint64_t server_cpu = 0;
  for (const auto& c : m_conns) {
    const std::uint64_t sent = c->data_sent.load();
    result.messages += sent;
    result.bytes += sent * m_options.size;
    server_cpu = std::max(server_cpu, c->report_body.cpu_ns);
    if (c->report_seq != sent || c->report_body.errors != 0 ||
        c->report_body.bytes != sent * m_options.size) {
      result.intact = false;
      result.error +=
          fmt::format("{}: sent {}, the server received {} ({} B, {} bad); ", c->address, sent,
                      c->report_seq, c->report_body.bytes, c->report_body.errors);
    }
  }
  if (m_pong_errors != 0) {
    result.intact = false;
    result.error += fmt::format("{} echoes came back wrong; ", m_pong_errors);
  }
  result.seconds = static_cast<double>(m_end_ns - t0) * 1e-9;
  if (m_options.test == Test::LATENCY) {
    // The last ping's report arrival is not part of the measurement: rate over round trips.
    result.seconds = static_cast<double>(m_deadline_ns - t0) * 1e-9;
  }
  const double msgs = static_cast<double>(std::max<std::uint64_t>(result.messages, 1));
  result.msgs_per_s = static_cast<double>(result.messages) / result.seconds;
  result.bytes_per_s = static_cast<double>(result.bytes) / result.seconds;
  result.cpu_ns_per_msg = static_cast<double>(cpu1 - cpu0) / msgs;
  result.server_cpu_ns_per_msg = static_cast<double>(server_cpu) / msgs;
  if (m_options.test == Test::LATENCY && !m_rtt_ns.empty()) {
    auto& v = m_rtt_ns;
    const std::size_t skip = std::min(m_options.warmup, v.size() / 10);
    v.erase(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(skip));
    std::sort(v.begin(), v.end());
    const auto at = [&](double q) {
      const auto i =
          std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())));
      return static_cast<double>(v[i]) / 1000.0;
    };
    result.p50_us = at(0.5);
    result.p99_us = at(0.99);
    result.p999_us = at(0.999);
  }
  // Close; the server's REPORT marked each connection as ending normally.
  for (auto& c : m_conns) {
    try {
      api([&] { m_backend->close_active_endpoint(c->address); });
    } catch (const std::exception&) {
      // Already gone.
    }
  }
  wait(
      [&] {
        return std::all_of(m_conns.begin(), m_conns.end(), [](const auto& c) { return c->closed; });
      },
      CLOSE_TIMEOUT);
  if (m_options.stats) result.stats = m_backend->backend_statistics();
  return result;
}

}  // namespace

std::shared_ptr<EpollEventLoop> make_loop(std::optional<std::chrono::microseconds> busy_poll) {
  if (!busy_poll) return std::make_shared<EpollEventLoop>();
  return std::make_shared<EpollEventLoop>(EpollEventLoop::Options{.busy_poll = *busy_poll});
}

RunResult run_client(const ClientOptions& options, const EndPointAddress& server) {
  Run run{options, server};
  return run.execute();
}

}  // namespace netio3::perf
