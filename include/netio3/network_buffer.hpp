#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <sys/uio.h>

#include <netio3/exceptions.hpp>
#include <netio3/export.hpp>

namespace netio3 {

/// A send buffer handed out by NetworkBackend::get_buffer. The application appends bytes
/// with write() and passes it to send_buffer(); the backend gives it back to its pool when
/// the send completes (or is cancelled). The buffer's id() is the key reported for it.
///
/// Thread safety: a buffer belongs to whoever holds it; it is not shared between threads
/// concurrently.
class NETIO3_API NetworkBuffer {
 public:
  /// A buffer over `storage` (not owned), empty; made by the backends' pools.
  NetworkBuffer(std::span<std::uint8_t> storage, std::uint64_t id) noexcept
      : m_storage{storage}, m_id{id} {}
  NetworkBuffer(const NetworkBuffer&) = delete;
  NetworkBuffer& operator=(const NetworkBuffer&) = delete;
  NetworkBuffer(NetworkBuffer&&) = delete;
  NetworkBuffer& operator=(NetworkBuffer&&) = delete;
  ~NetworkBuffer() = default;

  /// Appends bytes. Throws BufferOverflow (and writes nothing) if they do not fit.
  void write(std::span<const std::uint8_t> bytes) {
    reserve_for(bytes.size());
    if (!bytes.empty()) std::memcpy(m_storage.data() + m_size, bytes.data(), bytes.size());
    m_size += bytes.size();
  }

  /// Appends the bytes `iov` points to (as write(std::span<const std::uint8_t>)).
  void write(const iovec& iov) {
    write(
        std::span<const std::uint8_t>{static_cast<const std::uint8_t*>(iov.iov_base), iov.iov_len});
  }

  /// Appends the value's bytes in host byte order.
  template <std::integral T>
  void write(T value) {
    reserve_for(sizeof(T));
    std::memcpy(m_storage.data() + m_size, &value, sizeof(T));
    m_size += sizeof(T);
  }

  /// The start of the buffer's storage (capacity() bytes).
  [[nodiscard]] std::uint8_t* data() noexcept { return m_storage.data(); }
  /// The start of the buffer's storage (capacity() bytes).
  [[nodiscard]] const std::uint8_t* data() const noexcept { return m_storage.data(); }
  /// Bytes written so far: what send_buffer sends.
  [[nodiscard]] std::size_t size() const noexcept { return m_size; }
  /// Bytes the buffer holds at most.
  [[nodiscard]] std::size_t capacity() const noexcept { return m_storage.size(); }
  /// Bytes that can still be written: capacity() - size().
  [[nodiscard]] std::size_t available() const noexcept { return m_storage.size() - m_size; }
  /// The bytes written so far.
  [[nodiscard]] std::span<const std::uint8_t> bytes() const noexcept {
    return m_storage.first(m_size);
  }
  /// The key on_send_completed_cb (or the closed callback) reports for this buffer.
  [[nodiscard]] std::uint64_t id() const noexcept { return m_id; }

  /// For data placed directly into data(): sets the number of valid bytes.
  void resize(std::size_t size) {
    if (size > m_storage.size()) throw_overflow(size);
    m_size = size;
  }
  /// Empties the buffer (size() 0).
  void clear() noexcept { m_size = 0; }

 private:
  void reserve_for(std::size_t n) const {
    if (n > m_storage.size() - m_size) throw_overflow(m_size + n);
  }
  [[noreturn]] void throw_overflow(std::size_t wanted) const;

  std::span<std::uint8_t> m_storage;
  std::size_t m_size{};
  std::uint64_t m_id{};
};

}  // namespace netio3
