#pragma once

// LazyDeque: a std::deque that allocates nothing until its first element. libstdc++'s
// deque allocates its map and a 512-byte node when it is constructed; a connection keeps
// several queues (send ledger, send queue segments, marks, chunks), so every idle connection
// paid about 0.6 KiB per queue for nothing. Once used, it keeps its deque (and the deque its
// node) until destroyed, so a busy connection allocates no more than before.

#include <cstddef>
#include <deque>
#include <memory>
#include <utility>

namespace netio3::detail {

template <typename T>
class LazyDeque {
 public:
  using value_type = T;
  using iterator = typename std::deque<T>::iterator;
  using const_iterator = typename std::deque<T>::const_iterator;

  [[nodiscard]] bool empty() const noexcept { return !m_deque || m_deque->empty(); }
  [[nodiscard]] std::size_t size() const noexcept { return m_deque ? m_deque->size() : 0; }

  void push_back(const T& value) { deque().push_back(value); }
  void push_back(T&& value) { deque().push_back(std::move(value)); }
  template <typename... Args>
  T& emplace_back(Args&&... args) {
    return deque().emplace_back(std::forward<Args>(args)...);
  }

  // As std::deque: only on a non-empty queue.
  [[nodiscard]] T& front() noexcept { return m_deque->front(); }
  [[nodiscard]] const T& front() const noexcept { return m_deque->front(); }
  [[nodiscard]] T& back() noexcept { return m_deque->back(); }
  [[nodiscard]] const T& back() const noexcept { return m_deque->back(); }
  void pop_front() noexcept { m_deque->pop_front(); }
  void pop_back() noexcept { m_deque->pop_back(); }
  T& operator[](std::size_t i) noexcept { return (*m_deque)[i]; }
  const T& operator[](std::size_t i) const noexcept { return (*m_deque)[i]; }

  void clear() noexcept {
    if (m_deque) m_deque->clear();
  }

  // Value-initialised iterators compare equal: an unused queue is an empty range.
  [[nodiscard]] iterator begin() noexcept { return m_deque ? m_deque->begin() : iterator{}; }
  [[nodiscard]] iterator end() noexcept { return m_deque ? m_deque->end() : iterator{}; }
  [[nodiscard]] const_iterator begin() const noexcept {
    return m_deque ? m_deque->cbegin() : const_iterator{};
  }
  [[nodiscard]] const_iterator end() const noexcept {
    return m_deque ? m_deque->cend() : const_iterator{};
  }

  // Whether the deque has been allocated (for tests).
  [[nodiscard]] bool allocated() const noexcept { return m_deque != nullptr; }

 private:
  std::deque<T>& deque() {
    if (!m_deque) m_deque = std::make_unique<std::deque<T>>();
    return *m_deque;
  }

  std::unique_ptr<std::deque<T>> m_deque;
};

}  // namespace netio3::detail
