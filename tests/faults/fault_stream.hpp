#pragma once

// Streams of self-checking messages and the bookkeeping around them, shared by the fault
// tests and their peer program (netio3_fault_peer):
//
// * every message says which stream it belongs to and its sequence number, and carries a
//   pattern derived from both, so a receiver can tell that what it got is a gap-free,
//   in-order prefix of the stream with intact content;
// * an Observer owns the callbacks of one backend and records, per connection, what a test
//   needs to check the "every send that returned OK ends exactly once" rule: which keys
//   were accepted, completed or cancelled, and whether anything was reported after the
//   connection's closed callback;
// * a StreamSender sends a stream on one connection with back-pressure (waits on the
//   Observer, never sleeps).

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include <netio3/netio3.hpp>

namespace netio3::faults {

using Clock = std::chrono::steady_clock;

enum class SendMode { BUFFERED, ZERO_COPY, COPY };
[[nodiscard]] std::string_view to_string(SendMode mode);
[[nodiscard]] std::optional<SendMode> parse_send_mode(std::string_view name);

// A message: 16 bytes (stream id, sequence number; little endian) that travel as
// header_data (or at the start of a buffer), then a payload derived from both.
inline constexpr std::size_t HEADER_BYTES = 16;
[[nodiscard]] std::array<std::uint8_t, HEADER_BYTES> message_header(std::uint64_t stream,
                                                                    std::uint64_t seq);
void fill_payload(std::uint64_t stream, std::uint64_t seq, std::span<std::uint8_t> out);

// Steady-clock time in microseconds; CLOCK_MONOTONIC is shared by all processes of the
// host (network namespaces do not change it), so children can report when something
// happened and the test can compare it with its own clock.
[[nodiscard]] std::int64_t monotonic_us(Clock::time_point t = Clock::now());

// What one sender's keys on one connection went through: every send that returned OK must
// be reported exactly once (completed or cancelled), and nothing after the closed callback.
struct Ledger {
  enum State : std::uint8_t { NONE, ATTEMPT, OK, COMPLETED, CANCELLED };
  // Unique keys (zero-copy and copy sends: the sequence number) are followed one by one.
  // Buffer ids come back: a buffer is in the pool again before its completion callback runs,
  // so another send may use it while that callback is on its way; per id, the ledger counts
  // the sends not yet reported.
  bool unique_keys{true};
  std::vector<std::uint8_t> state;      // unique keys
  std::vector<std::int64_t> in_flight;  // buffer ids
  std::uint64_t ok_sends{0};
  std::uint64_t completed{0};
  std::uint64_t cancelled{0};
  std::vector<std::string> violations;

  // Around a send call (ATTEMPT first: the report can arrive before the call returns).
  void begin(std::uint64_t key);
  void end(std::uint64_t key, NetioStatus status, bool closed);
  void report(std::uint64_t key, State how, bool after_close);

  // Keys whose send returned OK and that were neither completed nor cancelled.
  [[nodiscard]] std::uint64_t unreported() const;
  // Unique keys: whether `key` was completed or cancelled.
  [[nodiscard]] bool reported(std::uint64_t key) const;
  [[nodiscard]] std::string summary() const;
};

struct StreamState {
  std::uint64_t received{0};  // messages of the in-order, intact prefix
  std::uint64_t bad{0};       // messages that broke it
  std::string first_error;
};

struct ConnectionState {
  EndPointAddress remote;
  Clock::time_point established_at{};
  bool closed{false};
  Clock::time_point closed_at{};
  std::vector<std::uint64_t> cancelled_keys;
  CloseReason close_reason;                                  // on_connection_closed_reason_cb
  std::map<std::uint64_t, std::uint64_t> received_at_close;  // stream id -> received
  Ledger ledger;
};

// The callbacks of one backend and what they reported, under one lock. Callbacks run on the
// loop thread; waits and accessors on any thread.
class Observer {
 public:
  // `message_size`: every message has this size (header included). `report` (optional)
  // gets one line per noteworthy event (ESTABLISHED, RECEIVED every `progress_every`
  // messages, BAD, CLOSED, REFUSED), under the lock: it must not call back into this.
  explicit Observer(std::size_t message_size,
                    std::function<void(const std::string&)> report = nullptr,
                    std::uint64_t progress_every = 0);

  [[nodiscard]] NetworkConfig config(NetworkMode mode = NetworkMode::TCP);

  // Waits until pred(*this) holds, evaluated under the lock; false at the deadline.
  bool wait(const std::function<bool(const Observer&)>& pred, Clock::time_point deadline);
  // pred(*this) under the lock, now.
  [[nodiscard]] bool holds(const std::function<bool(const Observer&)>& pred) const;
  // Wakes the waiters (e.g. after a stop request).
  void notify();

  // Accessors: inside wait() predicates, or through the locked copies below.
  [[nodiscard]] const ConnectionState* connection(const EndPointAddress& remote) const;
  [[nodiscard]] const StreamState* stream(std::uint64_t id) const;
  [[nodiscard]] std::uint64_t generation() const { return m_generation; }
  [[nodiscard]] std::size_t established_count() const { return m_connections.size(); }
  [[nodiscard]] std::size_t refused_count() const { return m_refused; }
  [[nodiscard]] const std::deque<ConnectionState>& connections() const { return m_connections; }
  [[nodiscard]] const std::vector<std::string>& violations() const { return m_violations; }

  [[nodiscard]] std::optional<ConnectionState> connection_copy(const EndPointAddress& remote) const;
  [[nodiscard]] StreamState stream_copy(std::uint64_t id) const;
  [[nodiscard]] std::uint64_t generation_now() const;
  [[nodiscard]] std::size_t established_count_now() const;
  [[nodiscard]] std::vector<std::string> violations_copy() const;
  // The remote of the n-th connection established (0-based).
  [[nodiscard]] std::optional<EndPointAddress> remote(std::size_t n) const;

  // The application's half of the NetworkBuffer lifetime rule ("valid until its
  // connection's closed callback"): a thread that uses a buffer from get_buffer holds this
  // lock from get_buffer to send_buffer, and the closed callback holds it while it runs, so
  // a connection's buffers are never released under a writer. Order: before the
  // observer's own lock.
  [[nodiscard]] std::unique_lock<std::mutex> lock_buffers() {
    return std::unique_lock{m_buffer_mutex};
  }

  // Ledger updates from the sending thread, around a send call.
  void begin_send(const EndPointAddress& remote, std::uint64_t key, bool unique_keys);
  void end_send(const EndPointAddress& remote, std::uint64_t key, NetioStatus status);

 private:
  ConnectionState* find(const EndPointAddress& remote);
  void update(const std::function<std::string()>& change);
  std::string on_data(std::span<const std::uint8_t> data);

  const std::size_t m_message_size;
  const std::function<void(const std::string&)> m_report;
  const std::uint64_t m_progress_every;

  std::mutex m_buffer_mutex;
  mutable std::mutex m_mutex;
  std::condition_variable m_cv;
  std::uint64_t m_generation{0};
  std::deque<ConnectionState> m_connections;  // in order of establishment
  std::map<std::uint64_t, StreamState> m_streams;
  std::size_t m_refused{0};
  std::vector<std::string> m_violations;  // reports that fit no connection
};

// Connection parameters for an endpoint that receives messages of up to `message_size`
// bytes and sends in `mode` (buffers of `message_size`, or zero-copy from `region`).
[[nodiscard]] ConnectionParameters connection_params(SendMode mode, std::size_t message_size,
                                                     std::span<std::uint8_t> region,
                                                     std::size_t num_buf = 64);

struct StreamPlan {
  EndPointAddress to;
  SendMode mode{SendMode::ZERO_COPY};
  std::size_t message_size{4096};
  std::uint64_t stream{1};
  std::uint64_t count{0};  // 0: until stopped, closed or failed
};

enum class StreamEnd { COUNT_REACHED, STOPPED, CLOSED, FAILED, THREW, TIMED_OUT };
[[nodiscard]] std::string_view to_string(StreamEnd end);

// Sends message 0, 1, ... of a stream. Zero-copy payloads live in `region` (one slot per
// message, reused once the message in it was reported); the region must be the one given in
// the connection's send_zero_copy_params.
class StreamSender {
 public:
  StreamSender(NetworkBackend& backend, Observer& observer, StreamPlan plan,
               std::span<std::uint8_t> region = {});

  // One attempt at the next message. NO_RESOURCES also when get_buffer has no buffer (see
  // no_buffer()) or the next zero-copy slot is still in use. Exceptions propagate.
  NetioStatus try_send();
  // Sends until the plan's count (or `until` sends, if not 0), a stop request, the
  // connection's closed callback, FAILED, an exception or the deadline. On NO_RESOURCES it
  // waits for any callback of the backend.
  StreamEnd run(std::stop_token stop, Clock::time_point deadline, std::uint64_t until = 0);

  [[nodiscard]] std::uint64_t sent() const { return m_next; }  // sends that returned OK
  [[nodiscard]] std::uint64_t no_resources() const { return m_no_resources; }
  [[nodiscard]] std::uint64_t no_buffer() const { return m_no_buffer; }
  [[nodiscard]] const std::string& error() const { return m_error; }
  [[nodiscard]] const StreamPlan& plan() const { return m_plan; }

 private:
  void prepare_payload(std::uint64_t seq);

  NetworkBackend& m_backend;
  Observer& m_observer;
  StreamPlan m_plan;
  std::span<std::uint8_t> m_region;
  std::size_t m_slots{0};
  std::vector<std::uint8_t> m_scratch;  // the payload of message m_scratch_seq
  std::uint64_t m_scratch_seq{~std::uint64_t{0}};
  std::uint64_t m_next{0};
  std::uint64_t m_no_resources{0};
  std::uint64_t m_no_buffer{0};
  std::string m_error;
};

}  // namespace netio3::faults
