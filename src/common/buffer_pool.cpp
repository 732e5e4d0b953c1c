#include "common/buffer_pool.hpp"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <sys/mman.h>

#include <fmt/format.h>

namespace netio3::detail {
namespace {
constexpr std::size_t ALIGN = 64;
constexpr std::size_t PAGE = 4096;
// Regions of at least this size are aligned to it and advised to the kernel as transparent
// huge pages (MADV_HUGEPAGE; used where /sys/kernel/mm/transparent_hugepage/enabled says
// "madvise" or "always"). A peer on the same host reads them with process_vm_readv (UCX's
// CMA lane), which pins the source's pages on every call (one 2 MiB page instead of 512
// 4 KiB ones). Measured with 1 MiB zero-copy messages (docs/benchmarks.md): the sender's
// region in huge pages 5.0 -> 9.2 GB/s, the receiver's pool alone 5.0 -> 6.1; a buffered
// sender's pool is the source of its reads. The cost: a pool whose pages are touched
// sparsely holds more resident memory.
constexpr std::size_t HUGE_PAGE = std::size_t{2} << 20U;
constexpr std::size_t round_up(std::size_t n, std::size_t a) {
  return (n + a - 1) / a * a;
}
}  // namespace

void BufferPool::FreeDeleter::operator()(std::uint8_t* p) const noexcept {
  std::free(p);  // NOLINT(cppcoreguidelines-no-malloc): paired with aligned_alloc
}

void BufferPool::ObjectsDeleter::operator()(NetworkBuffer* p) const noexcept {
  std::destroy_n(p, count);
  ::operator delete (p, std::align_val_t{alignof(NetworkBuffer)});
}

BufferPool::BufferPool(std::size_t num_buf, std::size_t buf_size, std::size_t headroom,
                       bool thread_safe)
    : m_buf_size{buf_size}, m_headroom{headroom}, m_mutex{thread_safe} {
  if (num_buf == 0 || buf_size == 0) {
    throw std::invalid_argument("buffer pool needs num_buf > 0 and buf_size > 0");
  }
  if (num_buf > std::numeric_limits<std::uint32_t>::max()) {
    throw std::invalid_argument(fmt::format("buffer pool: num_buf {} is too large", num_buf));
  }
  const std::size_t stride = round_up(headroom + buf_size, ALIGN);
  if (stride < buf_size || num_buf > std::numeric_limits<std::size_t>::max() / stride) {
    throw std::invalid_argument(fmt::format(
        "buffer pool: {} buffers of {} bytes overflow the address space", num_buf, buf_size));
  }
  m_region_size = round_up(num_buf * stride, PAGE);
  const bool huge = m_region_size >= HUGE_PAGE;
  if (huge) m_region_size = round_up(m_region_size, HUGE_PAGE);
  // Not zeroed: untouched pages of a large pool cost no resident memory.
  auto* mem =
      static_cast<std::uint8_t*>(std::aligned_alloc(huge ? HUGE_PAGE : PAGE, m_region_size));
  if (mem == nullptr) {
    throw std::bad_alloc();
  }
  // Advice only: a kernel without transparent huge pages refuses it, and 4 KiB pages serve.
  if (huge) (void)::madvise(mem, m_region_size, MADV_HUGEPAGE);
  m_memory.reset(mem);
  m_state.assign(num_buf, State::FREE);
  m_free.reserve(num_buf);
  auto* objects = static_cast<NetworkBuffer*>(
      ::operator new (num_buf * sizeof(NetworkBuffer), std::align_val_t{alignof(NetworkBuffer)}));
  m_buffers = std::unique_ptr<NetworkBuffer, ObjectsDeleter>{objects, ObjectsDeleter{0}};
  for (std::size_t i = 0; i < num_buf; ++i) {
    std::construct_at(objects + i, std::span<std::uint8_t>{mem + i * stride + headroom, buf_size},
                      i);
    m_buffers.get_deleter().count = i + 1;
  }
  m_count = num_buf;
  for (std::size_t i = num_buf; i-- > 0;) m_free.push_back(static_cast<std::uint32_t>(i));
}

NetworkBuffer* BufferPool::acquire() noexcept {
  const std::lock_guard lock{m_mutex};
  if (m_free.empty()) return nullptr;
  const auto id = m_free.back();
  m_free.pop_back();
  m_high_water = std::max(m_high_water, m_count - m_free.size());
  m_state[id] = State::LENT;
  NetworkBuffer& buffer = m_buffers.get()[id];
  buffer.clear();
  return &buffer;
}

bool BufferPool::owns(const NetworkBuffer* buffer) const noexcept {
  // By address only (see m_buffers).
  const auto first = reinterpret_cast<std::uintptr_t>(m_buffers.get());  // NOLINT
  const auto at = reinterpret_cast<std::uintptr_t>(buffer);              // NOLINT
  return at >= first && at < first + m_count * sizeof(NetworkBuffer) &&
         (at - first) % sizeof(NetworkBuffer) == 0;
}

bool BufferPool::begin_send(NetworkBuffer* buffer) noexcept {
  if (!owns(buffer)) return false;
  const std::lock_guard lock{m_mutex};
  auto& state = m_state[buffer->id()];
  if (state != State::LENT) return false;
  state = State::IN_FLIGHT;
  return true;
}

void BufferPool::abort_send(NetworkBuffer* buffer) noexcept {
  if (!owns(buffer)) return;
  const std::lock_guard lock{m_mutex};
  auto& state = m_state[buffer->id()];
  if (state == State::IN_FLIGHT) state = State::LENT;
}

void BufferPool::release(NetworkBuffer* buffer) noexcept {
  if (!owns(buffer)) return;
  const std::lock_guard lock{m_mutex};
  const auto id = static_cast<std::uint32_t>(buffer->id());
  if (m_state[id] == State::FREE) return;
  m_state[id] = State::FREE;
  m_free.push_back(id);
}

std::size_t BufferPool::free_count() const noexcept {
  const std::lock_guard lock{m_mutex};
  return m_free.size();
}

std::size_t BufferPool::high_water() const noexcept {
  const std::lock_guard lock{m_mutex};
  return m_high_water;
}

}  // namespace netio3::detail
