#pragma once

// The connection engine's ready-to-send episodes (on_ready_to_send_cb): a refused send or
// an empty pool begins one; a completion, a buffer back in the shared pool or the set-up ends it.
// Definitions of ConnectionEngine members (common/connection_engine.hpp, which includes this
// file at its end; including this file first works as well).

#include <memory>
#include <mutex>
#include <vector>

#include "common/connection_engine.hpp"

namespace netio3::detail {

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline bool ConnectionEngine<Derived, Conn, Listener>::ready_again(const Conn& conn) {
  // Not yet open: established() ends it; closing or closed: never.
  if (!still_open(conn)) return !shut_down();
  if ((conn.send_waits.exchange(0) & ConnectionBase::WAITING) == 0) return !shut_down();
  m_notifier.ready_to_send(conn.remote);
  return !shut_down();
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::send_refused(
    const std::shared_ptr<Conn>& conn, ConnectionBase::SendWait cause) {
  if ((conn->send_waits.fetch_or(cause) & cause) != 0) return;  // waiting on it already
  bool free_now = false;
  if (cause == ConnectionBase::WAIT_TRANSPORT) {
    const std::lock_guard lock{conn->mutex};
    free_now = conn->phase == Phase::OPEN && conn->ledger.outstanding() == 0;
  } else {
    BufferPool* pool = nullptr;
    bool shared = false;
    {
      const std::lock_guard lock{conn->mutex};
      pool = conn->send_pool;
      shared = pool != conn->own_send_pool.get();
    }
    if (pool == nullptr) return;
    if (shared) {
      const std::lock_guard lock{m_buffer_waiters_mutex};
      m_buffer_waiters.push_back(conn);
      m_buffer_waiters_exist.store(true);
    }
    free_now = pool->free_count() > 0;
  }
  if (free_now) post_ready(*conn);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::post_ready(const Conn& conn) {
  if ((conn.send_waits.fetch_or(ConnectionBase::READY_POSTED) & ConnectionBase::READY_POSTED) !=
      0) {
    return;
  }
  std::weak_ptr<Derived> weak = derived().weak_from_this();
  m_loop->post([weak, c = std::static_pointer_cast<const Conn>(conn.shared_from_this())] {
    if (auto self = weak.lock(); self && !self->shut_down()) (void)self->ready_again(*c);
  });
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::wake_buffer_waiters(const BufferPool* pool) {
  std::vector<std::shared_ptr<Conn>> wake;
  {
    const std::lock_guard lock{m_buffer_waiters_mutex};
    std::erase_if(m_buffer_waiters, [&](const std::weak_ptr<Conn>& w) {
      auto conn = w.lock();
      if (!conn) return true;
      if (conn->send_pool != pool) return false;
      wake.push_back(std::move(conn));
      return true;
    });
    m_buffer_waiters_exist.store(!m_buffer_waiters.empty(), std::memory_order_relaxed);
  }
  for (const auto& conn : wake) post_ready(*conn);
}

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
inline void ConnectionEngine<Derived, Conn, Listener>::post_buffer_wake(const BufferPool* pool) {
  std::weak_ptr<Derived> weak = derived().weak_from_this();
  m_loop->post([weak, pool] {
    if (auto self = weak.lock(); self && !self->shut_down()) self->wake_buffer_waiters(pool);
  });
}

}  // namespace netio3::detail
