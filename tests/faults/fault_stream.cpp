#include "fault_stream.hpp"

#include <algorithm>
#include <cstring>
#include <exception>

#include <fmt/format.h>

#include "test_support.hpp"

namespace netio3::faults {

std::string_view to_string(SendMode mode) {
  switch (mode) {
    case SendMode::BUFFERED:
      return "buffered";
    case SendMode::ZERO_COPY:
      return "zerocopy";
    case SendMode::COPY:
      return "copy";
  }
  return "?";
}

std::optional<SendMode> parse_send_mode(std::string_view name) {
  for (const auto mode : {SendMode::BUFFERED, SendMode::ZERO_COPY, SendMode::COPY}) {
    if (name == to_string(mode)) return mode;
  }
  return std::nullopt;
}

std::string_view to_string(StreamEnd end) {
  switch (end) {
    case StreamEnd::COUNT_REACHED:
      return "count reached";
    case StreamEnd::STOPPED:
      return "stopped";
    case StreamEnd::CLOSED:
      return "connection closed";
    case StreamEnd::FAILED:
      return "send FAILED";
    case StreamEnd::THREW:
      return "send threw";
    case StreamEnd::TIMED_OUT:
      return "deadline passed";
  }
  return "?";
}

namespace {

void put_le(std::uint64_t value, std::uint8_t* out) {
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(value >> (8 * i));
}

std::uint64_t get_le(const std::uint8_t* in) {
  std::uint64_t value = 0;
  for (std::size_t i = 0; i < 8; ++i) value |= std::uint64_t{in[i]} << (8 * i);
  return value;
}

std::uint64_t pattern_index(std::uint64_t stream, std::uint64_t seq) {
  return (stream << 40U) ^ seq;
}

}  // namespace

std::array<std::uint8_t, HEADER_BYTES> message_header(std::uint64_t stream, std::uint64_t seq) {
  std::array<std::uint8_t, HEADER_BYTES> header{};
  put_le(stream, header.data());
  put_le(seq, header.data() + 8);
  return header;
}

void fill_payload(std::uint64_t stream, std::uint64_t seq, std::span<std::uint8_t> out) {
  const auto bytes = test::pattern(pattern_index(stream, seq), out.size());
  std::copy(bytes.begin(), bytes.end(), out.begin());
}

std::int64_t monotonic_us(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

// ---- Ledger ------------------------------------------------------------------------------

namespace {

template <typename T>
T& slot(std::vector<T>& v, std::uint64_t key) {
  if (key >= v.size()) v.resize(std::max<std::size_t>(key + 1, 2 * v.size()));
  return v[key];
}

}  // namespace

void Ledger::begin(std::uint64_t key) {
  if (!unique_keys) {
    ++slot(in_flight, key);
    return;
  }
  auto& s = slot(state, key);
  if (s != NONE) violations.push_back(fmt::format("key {} is used a second time", key));
  s = ATTEMPT;
}

void Ledger::end(std::uint64_t key, NetioStatus status, bool closed) {
  if (status == NetioStatus::OK) ++ok_sends;
  if (!unique_keys) {
    if (status == NetioStatus::OK) return;
    if (--slot(in_flight, key) < 0) {
      violations.push_back(fmt::format("buffer {} was reported although its send returned {}", key,
                                       netio3::to_string(status)));
      in_flight[key] = 0;
    }
    return;
  }
  auto& s = slot(state, key);
  const bool already_reported = s == COMPLETED || s == CANCELLED;
  if (status != NetioStatus::OK) {
    if (already_reported) {
      violations.push_back(fmt::format("key {} was reported although its send returned {}", key,
                                       netio3::to_string(status)));
    }
    s = NONE;
  } else if (s == ATTEMPT) {
    s = OK;
    if (closed) {
      violations.push_back(fmt::format(
          "send of key {} returned OK after the closed callback: it can never be reported", key));
    }
  }
}

void Ledger::report(std::uint64_t key, State how, bool after_close) {
  const char* what = how == COMPLETED ? "completed" : "cancelled";
  if (after_close) {
    violations.push_back(
        fmt::format("key {} {} after the connection's closed callback", key, what));
  }
  bool outstanding = false;
  if (!unique_keys) {
    auto& n = slot(in_flight, key);
    outstanding = n > 0;
    if (outstanding) --n;
  } else {
    auto& s = slot(state, key);
    outstanding = s == ATTEMPT || s == OK;
    if (outstanding) s = how;
  }
  if (!outstanding) {
    violations.push_back(fmt::format("key {} {} but no send of it is outstanding", key, what));
    return;
  }
  ++(how == COMPLETED ? completed : cancelled);
}

std::uint64_t Ledger::unreported() const {
  if (!unique_keys) {
    std::int64_t n = 0;
    for (const auto f : in_flight) n += f;
    return static_cast<std::uint64_t>(n);
  }
  return static_cast<std::uint64_t>(std::count(state.begin(), state.end(), OK));
}

bool Ledger::reported(std::uint64_t key) const {
  return key < state.size() && (state[key] == COMPLETED || state[key] == CANCELLED);
}

std::string Ledger::summary() const {
  return fmt::format("ok={} completed={} cancelled={} unreported={} violations={}{}", ok_sends,
                     completed, cancelled, unreported(), violations.size(),
                     violations.empty() ? "" : " first: " + violations.front());
}

// ---- Observer ----------------------------------------------------------------------------

Observer::Observer(std::size_t message_size, std::function<void(const std::string&)> report,
                   std::uint64_t progress_every)
    : m_message_size{message_size}, m_report{std::move(report)}, m_progress_every{progress_every} {}

NetworkConfig Observer::config(NetworkMode mode) {
  NetworkConfig config{.mode = mode, .thread_safety = ThreadSafetyModel::SAFE};
  config.on_data_cb = [this](std::span<const std::uint8_t> data) {
    update([&] { return on_data(data); });
  };
  config.on_connection_established_cb = [this](const EndPointAddress& remote,
                                               EndpointCapabilities /*caps*/) {
    update([&] {
      ConnectionState& conn = m_connections.emplace_back();
      conn.remote = remote;
      conn.established_at = Clock::now();
      return fmt::format("ESTABLISHED {}", remote);
    });
  };
  config.on_connection_closed_reason_cb = [this](const EndPointAddress& remote,
                                                 const std::vector<std::uint64_t>& keys,
                                                 const CloseReason& reason) {
    const std::lock_guard buffers{m_buffer_mutex};  // see lock_buffers()
    const auto now = Clock::now();
    update([&]() -> std::string {
      ConnectionState* conn = find(remote);
      if (conn == nullptr) {
        m_violations.push_back(fmt::format("closed callback for {}: no open connection", remote));
        return {};
      }
      conn->closed = true;
      conn->closed_at = now;
      conn->cancelled_keys = keys;
      conn->close_reason = reason;
      for (const auto& [id, stream] : m_streams) conn->received_at_close[id] = stream.received;
      Ledger& ledger = conn->ledger;
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if (ledger.unique_keys && i > 0 && keys[i] <= keys[i - 1]) {
          ledger.violations.push_back(
              fmt::format("cancelled keys not in send order: {} after {}", keys[i], keys[i - 1]));
        }
        ledger.report(keys[i], Ledger::CANCELLED, false);
      }
      std::uint64_t received = 0;
      std::uint64_t bad = 0;
      for (const auto& [id, stream] : m_streams) {
        received += stream.received;
        bad += stream.bad;
      }
      return fmt::format("CLOSED at_us={} remote={} cancelled={} received={} bad={} cause={}",
                         monotonic_us(now), remote, keys.size(), received, bad, reason.cause);
    });
  };
  config.on_connection_refused_cb = [this](const EndPointAddress& remote) {
    update([&] {
      ++m_refused;
      return fmt::format("REFUSED {}", remote);
    });
  };
  config.on_send_completed_cb = [this](const EndPointAddress& remote, std::uint64_t key) {
    update([&]() -> std::string {
      ConnectionState* conn = find(remote);
      if (conn == nullptr) {
        m_violations.push_back(fmt::format("completion of key {} for unknown {}", key, remote));
        return {};
      }
      conn->ledger.report(key, Ledger::COMPLETED, conn->closed);
      return {};
    });
  };
  return config;
}

std::string Observer::on_data(std::span<const std::uint8_t> data) {
  if (data.size() < HEADER_BYTES) {
    StreamState& unknown = m_streams[~std::uint64_t{0}];
    if (unknown.bad++ == 0) unknown.first_error = fmt::format("message of {} bytes", data.size());
    return "BAD " + unknown.first_error;
  }
  const std::uint64_t id = get_le(data.data());
  const std::uint64_t seq = get_le(data.data() + 8);
  StreamState& stream = m_streams[id];
  std::string error;
  if (seq != stream.received) {
    error = fmt::format("stream {}: message {} where {} was due", id, seq, stream.received);
  } else if (data.size() != m_message_size) {
    error = fmt::format("stream {}: message {} has {} bytes, not {}", id, seq, data.size(),
                        m_message_size);
  } else if (!test::matches_pattern(data.subspan(HEADER_BYTES), pattern_index(id, seq))) {
    error = fmt::format("stream {}: message {} has corrupt content", id, seq);
  }
  if (!error.empty()) {
    if (stream.bad++ == 0) {
      stream.first_error = error;
      return "BAD " + error;
    }
    return {};
  }
  ++stream.received;
  if (m_progress_every != 0 && stream.received % m_progress_every == 0) {
    return fmt::format("RECEIVED {}", stream.received);
  }
  return {};
}

void Observer::begin_send(const EndPointAddress& remote, std::uint64_t key, bool unique_keys) {
  update([&]() -> std::string {
    ConnectionState* conn = find(remote);
    if (conn == nullptr) return {};
    conn->ledger.unique_keys = unique_keys;
    conn->ledger.begin(key);
    return {};
  });
}

void Observer::end_send(const EndPointAddress& remote, std::uint64_t key, NetioStatus status) {
  update([&]() -> std::string {
    ConnectionState* conn = find(remote);
    if (conn != nullptr) conn->ledger.end(key, status, conn->closed);
    return {};
  });
}

ConnectionState* Observer::find(const EndPointAddress& remote) {
  // The latest connection with that address: an address can come back after a close.
  for (auto it = m_connections.rbegin(); it != m_connections.rend(); ++it) {
    if (it->remote == remote) return &*it;
  }
  return nullptr;
}

const ConnectionState* Observer::connection(const EndPointAddress& remote) const {
  return const_cast<Observer*>(this)->find(remote);  // NOLINT: same lookup, read only
}

const StreamState* Observer::stream(std::uint64_t id) const {
  const auto it = m_streams.find(id);
  return it == m_streams.end() ? nullptr : &it->second;
}

void Observer::update(const std::function<std::string()>& change) {
  {
    const std::lock_guard lock{m_mutex};
    const std::string line = change();
    ++m_generation;
    // Under the lock, so that a waiter that saw the change prints after this line.
    if (!line.empty() && m_report) m_report(line);
  }
  m_cv.notify_all();
}

bool Observer::wait(const std::function<bool(const Observer&)>& pred, Clock::time_point deadline) {
  std::unique_lock lock{m_mutex};
  return m_cv.wait_until(lock, deadline, [&] { return pred(*this); });
}

bool Observer::holds(const std::function<bool(const Observer&)>& pred) const {
  const std::lock_guard lock{m_mutex};
  return pred(*this);
}

void Observer::notify() {
  { const std::lock_guard lock{m_mutex}; }  // a waiter between its check and its sleep
  m_cv.notify_all();
}

std::optional<ConnectionState> Observer::connection_copy(const EndPointAddress& remote) const {
  const std::lock_guard lock{m_mutex};
  const ConnectionState* conn = connection(remote);
  if (conn == nullptr) return std::nullopt;
  return *conn;
}

StreamState Observer::stream_copy(std::uint64_t id) const {
  const std::lock_guard lock{m_mutex};
  const StreamState* s = stream(id);
  return s == nullptr ? StreamState{} : *s;
}

std::uint64_t Observer::generation_now() const {
  const std::lock_guard lock{m_mutex};
  return m_generation;
}

std::size_t Observer::established_count_now() const {
  const std::lock_guard lock{m_mutex};
  return m_connections.size();
}

std::vector<std::string> Observer::violations_copy() const {
  const std::lock_guard lock{m_mutex};
  return m_violations;
}

std::optional<EndPointAddress> Observer::remote(std::size_t n) const {
  const std::lock_guard lock{m_mutex};
  if (n >= m_connections.size()) return std::nullopt;
  return m_connections[n].remote;
}

// ---- Sending -----------------------------------------------------------------------------

ConnectionParameters connection_params(SendMode mode, std::size_t message_size,
                                       std::span<std::uint8_t> region, std::size_t num_buf) {
  ConnectionParameters params{};
  params.recv_params = {.buf_size = message_size, .num_buf = num_buf};
  switch (mode) {
    case SendMode::BUFFERED:
      params.send_buffered_params = {.buf_size = message_size, .num_buf = num_buf};
      break;
    case SendMode::ZERO_COPY:
      params.send_zero_copy_params = {.buf_size = region.size(), .mr_start = region.data()};
      break;
    case SendMode::COPY:
      break;
  }
  return params;
}

StreamSender::StreamSender(NetworkBackend& backend, Observer& observer, StreamPlan plan,
                           std::span<std::uint8_t> region)
    : m_backend{backend},
      m_observer{observer},
      m_plan{std::move(plan)},
      m_region{region},
      m_scratch(m_plan.message_size - HEADER_BYTES) {
  if (m_plan.mode == SendMode::ZERO_COPY) {
    m_slots = m_scratch.empty() ? 1 : region.size() / m_scratch.size();
    if (m_slots == 0) throw std::invalid_argument("StreamSender: zero-copy region too small");
  }
}

void StreamSender::prepare_payload(std::uint64_t seq) {
  // Once per message, not per attempt: retries after NO_RESOURCES allocate nothing (the
  // RSS checks must see the library's memory, not the test's).
  if (m_scratch_seq == seq) return;
  fill_payload(m_plan.stream, seq, m_scratch);
  m_scratch_seq = seq;
}

NetioStatus StreamSender::try_send() {
  const std::uint64_t seq = m_next;
  const auto header = message_header(m_plan.stream, seq);
  const auto& to = m_plan.to;
  NetioStatus status = NetioStatus::FAILED;
  switch (m_plan.mode) {
    case SendMode::BUFFERED: {
      // The buffer must not be used once the closed callback has run: that callback waits
      // for this lock, and after it the connection counts as closed here.
      const auto buffers = m_observer.lock_buffers();
      if (m_observer.holds([&](const Observer& o) {
            const ConnectionState* conn = o.connection(to);
            return conn == nullptr || conn->closed;
          })) {
        return NetioStatus::FAILED;
      }
      NetworkBuffer* buffer = m_backend.get_buffer(to);
      if (buffer == nullptr) {
        ++m_no_buffer;
        return NetioStatus::NO_RESOURCES;
      }
      prepare_payload(seq);
      buffer->write(std::span<const std::uint8_t>{header});
      buffer->write(std::span<const std::uint8_t>{m_scratch});
      const std::uint64_t key = buffer->id();
      m_observer.begin_send(to, key, false);
      try {
        status = m_backend.send_buffer(to, buffer);
      } catch (...) {
        m_observer.end_send(to, key, NetioStatus::FAILED);
        throw;
      }
      m_observer.end_send(to, key, status);
      break;
    }
    case SendMode::ZERO_COPY: {
      if (seq >= m_slots) {
        const bool free = m_observer.holds([&](const Observer& o) {
          const ConnectionState* conn = o.connection(to);
          return conn != nullptr && conn->ledger.reported(seq - m_slots);
        });
        if (!free) return NetioStatus::NO_RESOURCES;  // the payload's slot is still in use
      }
      const std::span<std::uint8_t> payload =
          m_region.subspan((seq % m_slots) * m_scratch.size(), m_scratch.size());
      prepare_payload(seq);
      std::copy(m_scratch.begin(), m_scratch.end(), payload.begin());
      m_observer.begin_send(to, seq, true);
      try {
        status = m_backend.send_data(to, payload, header, seq);
      } catch (...) {
        m_observer.end_send(to, seq, NetioStatus::FAILED);
        throw;
      }
      m_observer.end_send(to, seq, status);
      break;
    }
    case SendMode::COPY: {
      prepare_payload(seq);
      m_observer.begin_send(to, seq, true);
      try {
        status = m_backend.send_data_copy(to, m_scratch, header, seq);
      } catch (...) {
        m_observer.end_send(to, seq, NetioStatus::FAILED);
        throw;
      }
      m_observer.end_send(to, seq, status);
      break;
    }
  }
  if (status == NetioStatus::OK) ++m_next;
  if (status == NetioStatus::NO_RESOURCES) ++m_no_resources;
  return status;
}

StreamEnd StreamSender::run(std::stop_token stop, Clock::time_point deadline, std::uint64_t until) {
  const std::stop_callback wake{stop, [this] { m_observer.notify(); }};
  const auto closed = [&](const Observer& o) {
    const ConnectionState* conn = o.connection(m_plan.to);
    return conn == nullptr || conn->closed;
  };
  std::uint64_t limit = m_plan.count == 0 ? ~std::uint64_t{0} : m_plan.count;
  if (until != 0) limit = std::min(limit, until);
  while (m_next < limit) {
    if (stop.stop_requested()) return StreamEnd::STOPPED;
    if (Clock::now() >= deadline) return StreamEnd::TIMED_OUT;
    std::uint64_t generation = 0;
    const bool is_closed = m_observer.holds([&](const Observer& o) {
      generation = o.generation();
      return closed(o);
    });
    if (is_closed) return StreamEnd::CLOSED;
    NetioStatus status = NetioStatus::FAILED;
    try {
      status = try_send();
    } catch (const std::exception& e) {
      m_error = e.what();
      return StreamEnd::THREW;
    }
    if (status == NetioStatus::FAILED) return StreamEnd::FAILED;
    if (status == NetioStatus::NO_RESOURCES) {
      // Back-pressure: whatever frees resources is reported through a callback.
      m_observer.wait(
          [&](const Observer& o) { return o.generation() != generation || stop.stop_requested(); },
          deadline);
    }
  }
  return StreamEnd::COUNT_REACHED;
}

}  // namespace netio3::faults
