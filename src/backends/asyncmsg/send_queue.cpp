#include "backends/asyncmsg/send_queue.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

namespace netio3::asyncmsg {

namespace {
constexpr std::uint64_t NOT_RETIRED = std::numeric_limits<std::uint64_t>::max();
}

std::uint8_t* SendQueue::reserve(std::size_t n) {
  if (!m_chunks.empty()) {
    auto& tail = m_chunks.back();
    if (tail.cap - tail.used >= n) {
      std::uint8_t* p = tail.mem.get() + tail.used;
      tail.used += n;
      return p;
    }
    tail.retire_at = m_appended;
  }
  const std::size_t cap = std::max(n, m_next_chunk);
  m_next_chunk = std::min(m_next_chunk * 2, MAX_CHUNK);
  m_chunks.push_back(Chunk{std::make_unique_for_overwrite<std::uint8_t[]>(cap), cap, n, NOT_RETIRED});
  m_tail_is_staged = false;  // a new chunk is never contiguous with the last segment
  return m_chunks.back().mem.get();
}

void SendQueue::push_segment(const std::uint8_t* ptr, std::size_t len, bool staged) {
  if (len == 0) return;
  if (staged && m_tail_is_staged && !m_segments.empty()) {
    auto& last = m_segments.back();
    if (last.ptr + last.len == ptr) {
      last.len += len;
      m_appended += len;
      return;
    }
  }
  m_segments.push_back(Segment{ptr, len});
  m_appended += len;
  m_tail_is_staged = staged;
}

void SendQueue::append_copy(std::span<const std::uint8_t> bytes) {
  if (bytes.empty()) return;
  std::uint8_t* dst = reserve(bytes.size());
  std::memcpy(dst, bytes.data(), bytes.size());
  push_segment(dst, bytes.size(), true);
}

void SendQueue::append_copy_pieces(std::span<const std::span<const std::uint8_t>> pieces) {
  std::size_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  if (total == 0) return;
  std::uint8_t* dst = reserve(total);
  std::uint8_t* out = dst;
  for (const auto& piece : pieces) {
    if (piece.empty()) continue;
    std::memcpy(out, piece.data(), piece.size());
    out += piece.size();
  }
  push_segment(dst, total, true);
}

void SendQueue::append_ref(std::span<const std::uint8_t> bytes) {
  push_segment(bytes.data(), bytes.size(), false);
}

void SendQueue::mark(detail::SendLedger::Ticket ticket) {
  m_marks.push_back(Mark{m_appended, ticket});
}

std::size_t SendQueue::gather(iovec* iov, std::size_t max_iov, std::size_t max_bytes) const {
  std::size_t count = 0;
  std::size_t bytes = 0;
  for (const auto& seg : m_segments) {
    if (count == max_iov || bytes >= max_bytes) break;
    const std::size_t len = std::min(seg.len, max_bytes - bytes);
    // iovec's base is non-const by POSIX; the kernel only reads it for a send.
    iov[count].iov_base = const_cast<std::uint8_t*>(seg.ptr);  // NOLINT(cppcoreguidelines-pro-type-const-cast)
    iov[count].iov_len = len;
    ++count;
    bytes += len;
  }
  return count;
}

void SendQueue::consume(std::size_t n, std::vector<detail::SendLedger::Ticket>& finished) {
  m_written += n;
  while (n > 0 && !m_segments.empty()) {
    auto& seg = m_segments.front();
    if (n < seg.len) {
      seg.ptr += n;
      seg.len -= n;
      n = 0;
      break;
    }
    n -= seg.len;
    m_segments.pop_front();
  }
  if (m_segments.empty()) m_tail_is_staged = false;
  while (!m_marks.empty() && m_marks.front().end <= m_written) {
    finished.push_back(m_marks.front().ticket);
    m_marks.pop_front();
  }
  while (!m_chunks.empty() && m_chunks.front().retire_at <= m_written) m_chunks.pop_front();
  if (m_segments.empty() && !m_chunks.empty()) {
    // Everything was written: the current chunk can be rewound instead of freed.
    auto& tail = m_chunks.back();
    tail.used = 0;
    if (tail.cap > KEEP_CHUNK) m_chunks.pop_back();
  }
}

void SendQueue::clear() noexcept {
  m_segments.clear();
  m_marks.clear();
  m_chunks.clear();
  m_written = m_appended;
  m_tail_is_staged = false;
}

}  // namespace netio3::asyncmsg
