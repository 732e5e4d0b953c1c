#pragma once

// Checked traffic for the reliability tests: message streams whose every message can be
// verified on arrival (stream id, sequence number, size, checksum, content), and a key
// ledger per connection that proves every accepted send ends exactly once.
//
// A message of stream s with sequence number n has a size and content that are functions
// of (s, n) alone, so the receiver knows what must come next on every stream:
//
//   size >= 16:  0..3 stream id, 4..11 sequence number, 12..15 checksum of 16..size,
//                16..  pseudo-random bytes from (s, n)
//   size < 16:   the first `size` pseudo-random bytes of (s, n); only the one "tiny"
//                stream per receiver sends these (a message that small cannot name its
//                stream, so the receiver attributes it to that stream)
//
// The data callback has no sender address, hence the stream id in the message.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <netio3/netio3.hpp>

namespace netio3::reliability {

inline constexpr std::size_t MESSAGE_HEADER = 16;
// Keys of send_data/send_data_copy start here; buffer ids (keys of buffered sends) are pool
// indices far below it, so a completion's key says which kind of send it ends.
inline constexpr std::uint64_t DATA_KEY_BASE = std::uint64_t{1} << 40U;

[[nodiscard]] std::uint64_t mix(std::uint64_t x) noexcept;

// Size of message `seq` of a stream: mostly up to 1 KiB, one in ten up to `max_size`, and
// for a tiny stream one in sixteen below MESSAGE_HEADER (0 included).
[[nodiscard]] std::size_t message_size(std::uint32_t stream, std::uint64_t seq, bool tiny,
                                       std::size_t max_size) noexcept;

// Writes message `seq` of `stream` (its size is out.size()).
void write_message(std::span<std::uint8_t> out, std::uint32_t stream, std::uint64_t seq);

// Checksum of the bytes after the message header.
[[nodiscard]] std::uint32_t checksum(std::span<const std::uint8_t> bytes) noexcept;

// The receiving side of a set of streams. verify() runs on the receiver's loop thread;
// the counters may be read from any thread.
class StreamChecker {
 public:
  struct Expect {
    bool tiny{};
    std::size_t max_size{};
  };
  // Streams [first, first + expects.size()) arrive at this receiver; the tiny one (at most
  // one) gets every message shorter than MESSAGE_HEADER.
  StreamChecker(std::uint32_t first, std::vector<Expect> expects);

  // Checks one message; returns an error text when it is not the next one of its stream.
  std::optional<std::string> verify(std::span<const std::uint8_t> message);

  [[nodiscard]] std::uint64_t received(std::uint32_t stream) const {
    return m_next[stream - m_first].load(std::memory_order_acquire);
  }
  [[nodiscard]] std::uint64_t received_total() const {
    return m_total.load(std::memory_order_acquire);
  }

 private:
  std::uint32_t m_first;
  std::vector<Expect> m_expects;
  std::optional<std::uint32_t> m_tiny;
  std::unique_ptr<std::atomic<std::uint64_t>[]> m_next;
  std::atomic<std::uint64_t> m_total{0};
  std::vector<std::uint8_t> m_scratch;
};

// The sender's record of one connection: which keys are outstanding. Every method is
// thread-safe. A violation (unknown or repeated key, completion after close) is recorded
// as an error text.
class KeyLedger {
 public:
  // Before the send call (the completion may come before the call returns).
  void expect(std::uint64_t key);
  // After a send that did not return OK: the key was never accepted.
  void withdraw(std::uint64_t key);
  void completed(std::uint64_t key);
  void closed(const std::vector<std::uint64_t>& cancelled);

  [[nodiscard]] bool is_closed() const;
  [[nodiscard]] std::size_t outstanding() const;
  [[nodiscard]] std::uint64_t accepted() const;
  [[nodiscard]] std::uint64_t completed_count() const;
  [[nodiscard]] std::uint64_t cancelled_count() const;
  [[nodiscard]] std::vector<std::string> errors() const;

 private:
  void end(std::uint64_t key, const char* how);

  mutable std::mutex m_mutex;
  // Keys of accepted sends not yet ended, with how often each is outstanding: data keys
  // are unique, but a buffer id may be lent again (and expected) in the moment between its
  // return to the pool and our completion callback recording the end of its last send.
  std::unordered_map<std::uint64_t, std::uint32_t> m_open;
  std::uint64_t m_accepted{0};
  std::uint64_t m_completed{0};
  std::uint64_t m_cancelled{0};
  bool m_closed{false};
  std::vector<std::string> m_errors;
};

}  // namespace netio3::reliability
