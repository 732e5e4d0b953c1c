#include "traffic.hpp"

#include <fmt/format.h>

#include "common/byte_order.hpp"

namespace netio3::reliability {

std::uint64_t mix(std::uint64_t x) noexcept {
  // splitmix64's finaliser.
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30U)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27U)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31U);
}

std::size_t message_size(std::uint32_t stream, std::uint64_t seq, bool tiny,
                         std::size_t max_size) noexcept {
  const std::uint64_t h = mix((std::uint64_t{stream} << 48U) ^ seq);
  if (tiny && h % 16 == 0) return (h >> 8U) % MESSAGE_HEADER;
  const std::size_t span = (h >> 4U) % 10 == 0 ? max_size - MESSAGE_HEADER : 1024 - MESSAGE_HEADER;
  return MESSAGE_HEADER + (h >> 12U) % (span + 1);
}

namespace {

// Pseudo-random bytes of message (stream, seq), 8 at a time.
void fill(std::span<std::uint8_t> out, std::uint32_t stream, std::uint64_t seq) {
  std::uint64_t x = mix((std::uint64_t{stream} << 40U) ^ (seq * 0x2545F4914F6CDD1DULL)) | 1U;
  std::size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    x ^= x << 13U;
    x ^= x >> 7U;
    x ^= x << 17U;
    std::memcpy(out.data() + i, &x, 8);
  }
  x ^= x << 13U;
  for (; i < out.size(); ++i) out[i] = static_cast<std::uint8_t>(x >> (8 * (i % 8)));
}

}  // namespace

std::uint32_t checksum(std::span<const std::uint8_t> bytes) noexcept {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  std::size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    std::uint64_t w = 0;
    std::memcpy(&w, bytes.data() + i, 8);
    h = (h ^ w) * 0x100000001B3ULL;
  }
  for (; i < bytes.size(); ++i) h = (h ^ bytes[i]) * 0x100000001B3ULL;
  return static_cast<std::uint32_t>(h ^ (h >> 32U));
}

void write_message(std::span<std::uint8_t> out, std::uint32_t stream, std::uint64_t seq) {
  if (out.size() < MESSAGE_HEADER) {
    fill(out, stream, seq);
    return;
  }
  const auto body = out.subspan(MESSAGE_HEADER);
  fill(body, stream, seq);
  detail::store_le32(out.data(), stream);
  detail::store_le32(out.data() + 4, static_cast<std::uint32_t>(seq));
  detail::store_le32(out.data() + 8, static_cast<std::uint32_t>(seq >> 32U));
  detail::store_le32(out.data() + 12, checksum(body));
}

StreamChecker::StreamChecker(std::uint32_t first, std::vector<Expect> expects)
    : m_first{first},
      m_expects{std::move(expects)},
      m_next{std::make_unique<std::atomic<std::uint64_t>[]>(m_expects.size())} {
  std::size_t largest = 0;
  for (std::uint32_t i = 0; i < m_expects.size(); ++i) {
    if (m_expects[i].tiny) m_tiny = m_first + i;
    largest = std::max(largest, m_expects[i].max_size);
  }
  m_scratch.resize(largest);
}

std::optional<std::string> StreamChecker::verify(std::span<const std::uint8_t> message) {
  std::uint32_t stream = 0;
  if (message.size() < MESSAGE_HEADER) {
    if (!m_tiny)
      return fmt::format("a {} B message, but no stream sends tiny ones", message.size());
    stream = *m_tiny;
  } else {
    stream = detail::load_le32(message.data());
    if (stream < m_first || stream - m_first >= m_expects.size()) {
      return fmt::format("message of {} B names stream {}, not one of [{}, {})", message.size(),
                         stream, m_first, m_first + m_expects.size());
    }
  }
  const std::uint32_t index = stream - m_first;
  const Expect& expect = m_expects[index];
  const std::uint64_t seq = m_next[index].load(std::memory_order_relaxed);
  const std::size_t size = message_size(stream, seq, expect.tiny, expect.max_size);
  if (message.size() != size) {
    return fmt::format("stream {}: message {} should have {} B, got {} B", stream, seq, size,
                       message.size());
  }
  if (size >= MESSAGE_HEADER) {
    const std::uint64_t got_seq = detail::load_le32(message.data() + 4) |
                                  (std::uint64_t{detail::load_le32(message.data() + 8)} << 32U);
    if (got_seq != seq) {
      return fmt::format("stream {}: expected message {}, got message {} ({} B)", stream, seq,
                         got_seq, size);
    }
    if (detail::load_le32(message.data() + 12) != checksum(message.subspan(MESSAGE_HEADER))) {
      return fmt::format("stream {}: message {} ({} B) fails its checksum", stream, seq, size);
    }
  }
  const auto expected = std::span<std::uint8_t>{m_scratch}.first(size);
  write_message(expected, stream, seq);
  if (size > 0 && std::memcmp(expected.data(), message.data(), size) != 0) {
    return fmt::format("stream {}: message {} ({} B) has wrong content", stream, seq, size);
  }
  m_next[index].store(seq + 1, std::memory_order_release);
  m_total.fetch_add(1, std::memory_order_acq_rel);
  return std::nullopt;
}

void KeyLedger::expect(std::uint64_t key) {
  const std::lock_guard lock{m_mutex};
  ++m_open[key];
  ++m_accepted;
}

void KeyLedger::withdraw(std::uint64_t key) {
  const std::lock_guard lock{m_mutex};
  auto it = m_open.find(key);
  if (it == m_open.end()) {
    m_errors.push_back(fmt::format("key {} ended although its send was not accepted", key));
    return;
  }
  if (--it->second == 0) m_open.erase(it);
  --m_accepted;
}

void KeyLedger::end(std::uint64_t key, const char* how) {
  auto it = m_open.find(key);
  if (it == m_open.end()) {
    m_errors.push_back(fmt::format("{} key {} that is not outstanding", how, key));
    return;
  }
  if (--it->second == 0) m_open.erase(it);
}

void KeyLedger::completed(std::uint64_t key) {
  const std::lock_guard lock{m_mutex};
  if (m_closed) {
    m_errors.push_back(fmt::format("completion of key {} after the closed callback", key));
    return;
  }
  end(key, "completion of");
  ++m_completed;
}

void KeyLedger::closed(const std::vector<std::uint64_t>& cancelled) {
  const std::lock_guard lock{m_mutex};
  if (m_closed) m_errors.emplace_back("a second closed callback");
  m_closed = true;
  for (const std::uint64_t key : cancelled) end(key, "cancellation of");
  m_cancelled += cancelled.size();
}

bool KeyLedger::is_closed() const {
  const std::lock_guard lock{m_mutex};
  return m_closed;
}

std::size_t KeyLedger::outstanding() const {
  const std::lock_guard lock{m_mutex};
  std::size_t n = 0;
  for (const auto& [key, count] : m_open) n += count;
  return n;
}

std::uint64_t KeyLedger::accepted() const {
  const std::lock_guard lock{m_mutex};
  return m_accepted;
}

std::uint64_t KeyLedger::completed_count() const {
  const std::lock_guard lock{m_mutex};
  return m_completed;
}

std::uint64_t KeyLedger::cancelled_count() const {
  const std::lock_guard lock{m_mutex};
  return m_cancelled;
}

std::vector<std::string> KeyLedger::errors() const {
  const std::lock_guard lock{m_mutex};
  return m_errors;
}

}  // namespace netio3::reliability
