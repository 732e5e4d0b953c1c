#pragma once

// A fixed set of equally sized send or receive buffers carved from one allocation (one
// region, so RDMA backends can register it once). Each buffer may have `headroom` bytes in
// front of NetworkBuffer::data() that only the backend writes (e.g. a frame header), so a
// buffered send leaves as one contiguous piece.
//
// A buffer is FREE (in the pool), LENT (handed to the application by get_buffer) or
// IN_FLIGHT (accepted by send_buffer, owned by the backend until completion or cancel).
// Thread-safe when constructed with thread_safe = true.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <netio3/network_buffer.hpp>

#include "common/thread_model.hpp"

namespace netio3::detail {

class BufferPool {
 public:
  BufferPool(std::size_t num_buf, std::size_t buf_size, std::size_t headroom, bool thread_safe);
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;
  BufferPool(BufferPool&&) = delete;
  BufferPool& operator=(BufferPool&&) = delete;
  ~BufferPool() = default;

  // FREE -> LENT with size 0; nullptr when none is free.
  [[nodiscard]] NetworkBuffer* acquire() noexcept;
  // LENT -> IN_FLIGHT. False if the pointer is not a buffer of this pool or not lent.
  [[nodiscard]] bool begin_send(NetworkBuffer* buffer) noexcept;
  // IN_FLIGHT -> LENT, when a send was refused after begin_send.
  void abort_send(NetworkBuffer* buffer) noexcept;
  // IN_FLIGHT or LENT -> FREE.
  void release(NetworkBuffer* buffer) noexcept;

  [[nodiscard]] bool owns(const NetworkBuffer* buffer) const noexcept;
  // The headroom in front of buffer->data().
  [[nodiscard]] static std::uint8_t* headroom_of(NetworkBuffer* buffer,
                                                 std::size_t headroom) noexcept {
    return buffer->data() - headroom;
  }
  [[nodiscard]] std::span<std::uint8_t> region() const noexcept {
    return {m_memory.get(), m_region_size};
  }
  [[nodiscard]] std::size_t buf_size() const noexcept { return m_buf_size; }
  [[nodiscard]] std::size_t num_buf() const noexcept { return m_count; }
  [[nodiscard]] std::size_t headroom() const noexcept { return m_headroom; }
  [[nodiscard]] std::size_t free_count() const noexcept;
  // The most buffers lent out or in flight at once so far.
  [[nodiscard]] std::size_t high_water() const noexcept;

 private:
  enum class State : std::uint8_t { FREE, LENT, IN_FLIGHT };
  struct FreeDeleter {
    void operator()(std::uint8_t* p) const noexcept;
  };

  std::size_t m_buf_size;
  std::size_t m_headroom;
  std::size_t m_region_size{};
  std::unique_ptr<std::uint8_t, FreeDeleter> m_memory;
  // The NetworkBuffer objects, one array (they never move): owns() can tell whether a
  // pointer is one of them by its address alone, without reading through it - an
  // application may hand back a pointer whose connection (and pool) is already gone.
  struct ObjectsDeleter {
    std::size_t count;
    void operator()(NetworkBuffer* p) const noexcept;
  };
  std::unique_ptr<NetworkBuffer, ObjectsDeleter> m_buffers;
  std::size_t m_count{0};
  std::vector<State> m_state;
  std::vector<std::uint32_t> m_free;  // LIFO: the most recently used buffer is warm in cache
  std::size_t m_high_water{0};
  mutable OptionalMutex m_mutex;
};

}  // namespace netio3::detail
