#pragma once

// The bytes a connection has accepted but not yet handed to the kernel.
//
// The queue is a list of segments in stream order. Copied bytes (frame headers, the
// header_data of zero-copy sends, whole immediate sends) go into staging chunks; when a
// copy lands right after the previous copied bytes the last segment simply grows, so many
// small messages leave in one contiguous piece and one system call. Zero-copy payloads and
// buffered sends are referenced in place.
//
// Each accepted message leaves a mark at the stream offset where it ends; once the kernel
// has taken bytes up to that offset, the mark's ledger ticket completes.
//
// Concurrency: appends and consume() run under the connection's lock. gather() fills an
// iovec array under the lock; the write itself happens after unlocking. That is safe
// because appends never move or rewrite bytes that gather() has already handed out: chunks
// are never reallocated, and a growing segment only gains bytes at its end.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <sys/uio.h>
#include <vector>

#include "common/lazy_deque.hpp"
#include "common/send_ledger.hpp"

namespace netio3::asyncmsg {

// Staging memory shared by the connections of one backend: equally sized chunks, kept
// (up to a bound) when a connection's queue drains, so a busy connection never goes back
// to malloc and an idle one holds no staging memory. Thread-safe.
class ChunkCache {
 public:
  static constexpr std::size_t CHUNK_SIZE = std::size_t{256} << 10U;

  explicit ChunkCache(std::size_t max_cached) : m_max_cached{max_cached} {}

  [[nodiscard]] std::unique_ptr<std::uint8_t[]> take();
  void give(std::unique_ptr<std::uint8_t[]> chunk) noexcept;
  [[nodiscard]] std::size_t cached() const;

 private:
  mutable std::mutex m_mutex;
  std::vector<std::unique_ptr<std::uint8_t[]>> m_free;
  std::size_t m_max_cached;
};

class SendQueue {
 public:
  static constexpr std::size_t CHUNK_SIZE = ChunkCache::CHUNK_SIZE;

  // Without a cache, chunks are allocated and freed directly (tests).
  explicit SendQueue(std::shared_ptr<ChunkCache> cache = nullptr) : m_cache{std::move(cache)} {}
  SendQueue(const SendQueue&) = delete;
  SendQueue& operator=(const SendQueue&) = delete;
  SendQueue(SendQueue&&) = delete;
  SendQueue& operator=(SendQueue&&) = delete;
  ~SendQueue() { clear(); }

  // Copies bytes into staging; a copy larger than the room left continues in the next
  // chunk (a segment never crosses a chunk boundary).
  void append_copy(std::span<const std::uint8_t> bytes);
  // References caller-owned memory.
  void append_ref(std::span<const std::uint8_t> bytes);
  // Marks the end of a message at the current tail.
  void mark(detail::SendLedger::Ticket ticket);

  // Fills up to max_iov iovecs (at most max_bytes in total) from the head.
  std::size_t gather(iovec* iov, std::size_t max_iov, std::size_t max_bytes) const;
  // Bytes from the head to the end of the `messages`-th message not yet written (the whole
  // queue when fewer are queued): a write of at most that many bytes ends at most that many
  // messages (copy sends share staging segments, so iovecs alone do not bound them).
  [[nodiscard]] std::size_t bytes_for_messages(std::size_t messages) const noexcept;
  // The kernel took n bytes; appends the tickets of messages now fully written. Chunks
  // no segment points into any more go back to the cache.
  void consume(std::size_t n, std::vector<detail::SendLedger::Ticket>& finished);
  // Drops everything (on close).
  void clear() noexcept;

  // A session connection's replay log (DeliveryParameters::Session) is a second queue that
  // keeps every message until the peer acknowledges it; the queue written to the socket
  // references its bytes.
  // The stream offset of the end of what was appended.
  [[nodiscard]] std::uint64_t appended() const noexcept { return m_appended; }
  // The offset where the message of `ticket` begins (its predecessors' end; `appended()`
  // past the last one).
  [[nodiscard]] std::uint64_t start_of(detail::SendLedger::Ticket ticket) const noexcept;
  // References (and marks) what `log` holds from offset `from` on: the messages appended to
  // it since, or those to send again after a resume.
  void append_refs_from(const SendQueue& log, std::uint64_t from);
  // Drops the messages of tickets below `count` (acknowledged) from the head.
  void release_below(detail::SendLedger::Ticket count);

  [[nodiscard]] bool empty() const noexcept { return m_segments.empty(); }
  [[nodiscard]] std::uint64_t unsent_bytes() const noexcept { return m_appended - m_written; }
  [[nodiscard]] std::size_t chunks() const noexcept { return m_chunks.size(); }

 private:
  struct Segment {
    const std::uint8_t* ptr;
    std::size_t len;
  };
  struct Mark {
    std::uint64_t end;
    detail::SendLedger::Ticket ticket;
  };
  struct Chunk {
    std::unique_ptr<std::uint8_t[]> mem;
    std::size_t used;
    // Stream offset after which no segment points into this chunk any more; set when a
    // newer chunk takes over.
    std::uint64_t retire_at;
  };

  void copy_bytes(const std::uint8_t* src, std::size_t n);
  void push_segment(const std::uint8_t* ptr, std::size_t len, bool staged);
  void release(Chunk& chunk) noexcept;

  std::shared_ptr<ChunkCache> m_cache;
  detail::LazyDeque<Segment> m_segments;
  detail::LazyDeque<Mark> m_marks;
  detail::LazyDeque<Chunk> m_chunks;
  std::uint64_t m_appended{0};
  std::uint64_t m_written{0};
  // True while the last segment ends at the tail of the current staging chunk.
  bool m_tail_is_staged{false};
};

}  // namespace netio3::asyncmsg
