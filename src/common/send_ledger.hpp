#pragma once

// The per-connection record of accepted sends: the piece that makes "every send that
// returned OK ends exactly once" hold for every backend.
//
// add() is called when a send is accepted and returns a ticket. The transport later
// completes tickets (in any order: UCX rendezvous sends may finish after later eager
// ones) or, on close, cancels everything still open. Once cancel_all() has run the ledger
// is closed: it accepts no more sends and completes nothing, so no completion can follow
// the closed callback. Not thread-safe: guarded by the owning connection's lock.
//
// On an acknowledged connection (DeliveryParameters) a send ends when both the transport
// completed it and the peer acknowledged it: tickets are numbered in the order the messages
// go on the wire, the peer counts what it handed to its application, and acknowledge(n)
// says that tickets below n were delivered. Either may come first (a UCX rendezvous send's
// completion can follow the acknowledgement of its delivery).

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <vector>

#include <netio3/network_buffer.hpp>

#include "common/buffer_pool.hpp"
#include "common/lazy_deque.hpp"

namespace netio3::detail {

struct PendingSend {
  std::uint64_t key{};
  NetworkBuffer* buffer{};  // buffered sends: returned to the pool when the send ends
  std::uint64_t bytes{};    // header_data + payload (buffered sends: the buffer's size)
};

class SendLedger {
 public:
  using Ticket = std::uint64_t;

  // What the ledger has seen (ConnectionStatistics).
  struct Counts {
    std::uint64_t accepted{};
    std::uint64_t completed{};
    std::uint64_t cancelled{};
    std::uint64_t bytes_completed{};
  };

  // Sends end only once acknowledged (before the first add()).
  void expect_acknowledgements() noexcept {
    assert(accepted() == 0);
    m_delivered = 0;
  }
  [[nodiscard]] bool acknowledged() const noexcept { return m_delivered != NOT_ACKNOWLEDGED; }
  // Bytes of the sends accepted and not ended (the replay window's measure).
  [[nodiscard]] std::uint64_t outstanding_bytes() const noexcept { return m_outstanding_bytes; }

  [[nodiscard]] bool closed() const noexcept { return m_closed; }
  // Accepted sends are numbered from 0 (their tickets), so their count and what is still
  // open are derived rather than counted on every send.
  [[nodiscard]] std::size_t outstanding() const noexcept {
    return static_cast<std::size_t>(accepted() - m_completed - m_cancelled);
  }
  [[nodiscard]] Counts counts() const noexcept {
    return Counts{.accepted = accepted(),
                  .completed = m_completed,
                  .cancelled = m_cancelled,
                  .bytes_completed = m_bytes_completed};
  }

  Ticket add(PendingSend send) {
    assert(!m_closed);
    if (send.buffer != nullptr) send.bytes = send.buffer->size();
    m_entries.push_back(Entry{send, false, false});
    m_outstanding_bytes += send.bytes;
    return m_base + m_entries.size() - 1;
  }

  // Undoes the latest add(), for a send the transport refused right away (it was never
  // accepted, so it must not end in a completion or a cancelled-key list).
  void retract(Ticket ticket) noexcept {
    assert(!m_closed && !m_entries.empty() && ticket == m_base + m_entries.size() - 1);
    (void)ticket;
    m_outstanding_bytes -= m_entries.back().send.bytes;
    m_entries.pop_back();
  }

  // The transport completed one ticket: true when that ends the send (`out`); false if it is
  // unknown, already completed, the ledger was cancelled, or (acknowledged) the peer has not
  // acknowledged it yet - acknowledge() ends it then.
  bool complete(Ticket ticket, PendingSend& out) noexcept {
    if (m_closed || ticket < m_base || ticket - m_base >= m_entries.size()) return false;
    auto& entry = m_entries[ticket - m_base];
    if (entry.transported) return false;
    entry.transported = true;
    if (ticket >= m_delivered) return false;
    out = end(entry);
    pop_ended();
    return true;
  }

  // The peer acknowledged the delivery of every ticket below `count`: the sends this ends
  // (the transport completed them too) are appended to `out` in ticket order. False (and
  // nothing changes) when `count` goes back or past what was accepted: the peer broke the
  // protocol. A closed ledger ignores it.
  bool acknowledge(std::uint64_t count, std::vector<PendingSend>& out) {
    if (m_closed) return true;
    if (count < m_delivered || count > accepted()) return false;
    if (m_transported_first) {
      // The peer cannot have been handed what was not sent yet (a session's messages are kept
      // in memory that is freed on acknowledgement while the socket may still need it).
      for (Ticket t = std::max(m_delivered, m_base); t < count; ++t) {
        if (!m_entries[t - m_base].transported) return false;
      }
    }
    for (Ticket t = std::max(m_delivered, m_base); t < count; ++t) {
      auto& entry = m_entries[t - m_base];
      if (entry.transported && !entry.ended) out.push_back(end(entry));
    }
    m_delivered = count;
    pop_ended();
    return true;
  }

  // Acknowledgements must not count past what the transport completed (a transport whose
  // completion comes before the peer can receive: asyncmsg's write to the kernel).
  void expect_transport_first() noexcept { m_transported_first = true; }

  // A session resumed: the tickets from `count` on go on the wire again, and count as not
  // transported until the transport completes them once more.
  void send_again_from(Ticket count) noexcept {
    for (Ticket t = std::max(count, m_base); t < accepted(); ++t) {
      m_entries[t - m_base].transported = false;
    }
  }

  // Ends every open send as cancelled, in acceptance order, and closes the ledger.
  std::vector<PendingSend> cancel_all() {
    std::vector<PendingSend> cancelled;
    cancelled.reserve(outstanding());
    for (const auto& entry : m_entries) {
      if (!entry.ended) cancelled.push_back(entry.send);
    }
    m_cancelled += cancelled.size();
    m_base += m_entries.size();
    m_entries.clear();
    m_outstanding_bytes = 0;
    m_closed = true;
    return cancelled;
  }

 private:
  static constexpr std::uint64_t NOT_ACKNOWLEDGED = ~std::uint64_t{0};
  struct Entry {
    PendingSend send;
    bool transported;  // the transport completed it
    bool ended;        // and (acknowledged) the peer delivered it: reported
  };
  LazyDeque<Entry> m_entries;
  [[nodiscard]] std::uint64_t accepted() const noexcept { return m_base + m_entries.size(); }

  PendingSend end(Entry& entry) noexcept {
    entry.ended = true;
    ++m_completed;
    m_bytes_completed += entry.send.bytes;
    m_outstanding_bytes -= entry.send.bytes;
    return entry.send;
  }
  void pop_ended() noexcept {
    while (!m_entries.empty() && m_entries.front().ended) {
      m_entries.pop_front();
      ++m_base;
    }
  }

  // Tickets below it were delivered (acknowledged connections); NOT_ACKNOWLEDGED: every
  // ticket counts as delivered.
  std::uint64_t m_delivered{NOT_ACKNOWLEDGED};
  std::uint64_t m_outstanding_bytes{0};
  Ticket m_base{0};  // ticket of m_entries.front()
  std::uint64_t m_completed{0};
  std::uint64_t m_cancelled{0};
  std::uint64_t m_bytes_completed{0};
  bool m_closed{false};
  bool m_transported_first{false};
};

// Cancels every open send of a connection (closing its ledger): the buffers of buffered
// sends go back to `pool`, the keys come back in send order for on_connection_closed_cb.
inline std::vector<std::uint64_t> cancel_all_sends(SendLedger& ledger, BufferPool* pool) {
  std::vector<std::uint64_t> keys;
  for (const auto& send : ledger.cancel_all()) {
    if (send.buffer != nullptr && pool != nullptr) pool->release(send.buffer);
    keys.push_back(send.key);
  }
  return keys;
}

}  // namespace netio3::detail
