#include "backends/asyncmsg/send_queue.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

namespace netio3::asyncmsg {

namespace {
constexpr std::uint64_t NOT_RETIRED = std::numeric_limits<std::uint64_t>::max();
}

std::unique_ptr<std::uint8_t[]> ChunkCache::take() {
  {
    const std::lock_guard lock{m_mutex};
    if (!m_free.empty()) {
      auto chunk = std::move(m_free.back());
      m_free.pop_back();
      return chunk;
    }
  }
  return std::make_unique_for_overwrite<std::uint8_t[]>(CHUNK_SIZE);
}

void ChunkCache::give(std::unique_ptr<std::uint8_t[]> chunk) noexcept {
  const std::lock_guard lock{m_mutex};
  if (m_free.size() < m_max_cached) m_free.push_back(std::move(chunk));
  // else: freed here, outside the cache's bound
}

std::size_t ChunkCache::cached() const {
  const std::lock_guard lock{m_mutex};
  return m_free.size();
}

void SendQueue::release(Chunk& chunk) noexcept {
  if (m_cache) m_cache->give(std::move(chunk.mem));
  chunk.mem.reset();
}

void SendQueue::push_segment(const std::uint8_t* ptr, std::size_t len, bool staged) {
  if (len == 0) return;
  // Copies grow the last staged segment; references to bytes that follow the last segment's
  // in memory (a replay log's, buffers of one pool) join it too: one iovec.
  if ((!staged || m_tail_is_staged) && !m_segments.empty()) {
    auto& last = m_segments.back();
    if (last.ptr + last.len == ptr) {
      last.len += len;
      m_appended += len;
      if (!staged) m_tail_is_staged = false;
      return;
    }
  }
  m_segments.push_back(Segment{ptr, len});
  m_appended += len;
  m_tail_is_staged = staged;
}

void SendQueue::copy_bytes(const std::uint8_t* src, std::size_t n) {
  while (n > 0) {
    if (m_chunks.empty() || m_chunks.back().used == CHUNK_SIZE) {
      if (!m_chunks.empty()) m_chunks.back().retire_at = m_appended;
      m_chunks.push_back(Chunk{
          m_cache ? m_cache->take() : std::make_unique_for_overwrite<std::uint8_t[]>(CHUNK_SIZE), 0,
          NOT_RETIRED});
      m_tail_is_staged = false;  // a new chunk is never contiguous with the last segment
    }
    auto& tail = m_chunks.back();
    const std::size_t take = std::min(n, CHUNK_SIZE - tail.used);
    std::uint8_t* dst = tail.mem.get() + tail.used;
    std::memcpy(dst, src, take);
    tail.used += take;
    push_segment(dst, take, true);
    src += take;
    n -= take;
  }
}

void SendQueue::append_copy(std::span<const std::uint8_t> bytes) {
  if (!bytes.empty()) copy_bytes(bytes.data(), bytes.size());
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
    iov[count].iov_base = const_cast<std::uint8_t*>(seg.ptr);  // NOLINT
    iov[count].iov_len = len;
    ++count;
    bytes += len;
  }
  return count;
}

std::size_t SendQueue::bytes_for_messages(std::size_t messages) const noexcept {
  if (messages == 0) return 0;
  if (m_marks.size() < messages) return static_cast<std::size_t>(m_appended - m_written);
  return static_cast<std::size_t>(m_marks[messages - 1].end - m_written);
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
  while (!m_marks.empty() && m_marks.front().end <= m_written) {
    finished.push_back(m_marks.front().ticket);
    m_marks.pop_front();
  }
  while (!m_chunks.empty() && m_chunks.front().retire_at <= m_written) {
    release(m_chunks.front());
    m_chunks.pop_front();
  }
  if (m_segments.empty()) {
    // Drained: the current chunk goes back to the cache too; an idle queue holds nothing.
    for (auto& chunk : m_chunks) release(chunk);
    m_chunks.clear();
    m_tail_is_staged = false;
  }
}

std::uint64_t SendQueue::start_of(detail::SendLedger::Ticket ticket) const noexcept {
  std::uint64_t start = m_written;
  for (const auto& mark : m_marks) {
    if (mark.ticket >= ticket) return start;
    start = mark.end;
  }
  return m_appended;
}

void SendQueue::append_refs_from(const SendQueue& log, std::uint64_t from) {
  const std::uint64_t base = m_appended;
  // The log's segments and marks that end after `from`: its newest, so found from the back.
  std::size_t first_segment = log.m_segments.size();
  std::uint64_t segment_start = log.m_appended;
  while (first_segment > 0 && segment_start > from) {
    --first_segment;
    segment_start -= log.m_segments[first_segment].len;
  }
  for (std::size_t i = first_segment; i < log.m_segments.size(); ++i) {
    const auto& seg = log.m_segments[i];
    const std::uint64_t skip = from > segment_start ? from - segment_start : 0;
    segment_start += seg.len;
    if (skip >= seg.len) continue;
    push_segment(seg.ptr + skip, seg.len - static_cast<std::size_t>(skip), false);
  }
  std::size_t first_mark = log.m_marks.size();
  while (first_mark > 0 && log.m_marks[first_mark - 1].end > from) --first_mark;
  for (std::size_t i = first_mark; i < log.m_marks.size(); ++i) {
    m_marks.push_back(Mark{base + (log.m_marks[i].end - from), log.m_marks[i].ticket});
  }
}

void SendQueue::release_below(detail::SendLedger::Ticket count) {
  std::uint64_t upto = m_written;
  while (!m_marks.empty() && m_marks.front().ticket < count) {
    upto = m_marks.front().end;
    m_marks.pop_front();
  }
  if (upto == m_written) return;
  std::vector<detail::SendLedger::Ticket> none;  // their marks are gone: stays empty
  consume(static_cast<std::size_t>(upto - m_written), none);
}

void SendQueue::clear() noexcept {
  m_segments.clear();
  m_marks.clear();
  for (auto& chunk : m_chunks) release(chunk);
  m_chunks.clear();
  m_written = m_appended;
  m_tail_is_staged = false;
}

}  // namespace netio3::asyncmsg
