// asyncmsg backend: receive memory (limits.max_receive_memory), admitted per message,
// and the connections whose reading waits for it.

#include "backends/asyncmsg/asyncmsg_backend_impl.hpp"

namespace netio3::asyncmsg {

bool Backend::admit(Connection& conn, std::size_t length) {
  release_receive_memory(conn);  // a new body: the previous one is complete
  if (length > m_config.limits.max_receive_memory - m_receive_reserved) return false;
  m_receive_reserved += length;
  conn.reserved = length;
  return true;
}

void Backend::release_receive_memory(Connection& conn) {
  if (conn.reserved == 0) return;
  m_receive_reserved -= conn.reserved;
  conn.reserved = 0;
  if (!m_receive_waiting.empty() && !m_resume_posted) {
    m_resume_posted = true;
    std::weak_ptr<Backend> weak = weak_from_this();
    m_loop->post([weak] {
      if (auto self = weak.lock()) self->resume_waiting();
    });
  }
}

void Backend::pause_receiving(const std::shared_ptr<Connection>& conn) {
  NETIO3_DEBUG("asyncmsg: connection with {}: waiting for receive memory ({} of {} bytes held)",
               conn->remote, m_receive_reserved, m_config.limits.max_receive_memory);
  conn->receive_paused = true;
  update_events(*conn);
  m_receive_waiting.push_back(conn);
}

void Backend::resume_waiting() {
  m_resume_posted = false;
  while (!m_receive_waiting.empty() && !shut_down()) {
    const auto conn = m_receive_waiting.front().lock();
    if (!conn || conn->ending() || !conn->receive_paused) {
      m_receive_waiting.pop_front();
      continue;
    }
    const auto status = conn->decoder.resume(
        [&](const Greeting& g) { return on_greeting(conn, g); },
        [&](std::span<const std::uint8_t> message) { return on_message(conn, message); },
        [&](std::size_t length) { return admit(*conn, length); });
    if (shut_down()) return;
    // Still first in line (perhaps with a later message of the kept bytes).
    if (status == FrameDecoder::Status::PAUSED) return;
    m_receive_waiting.pop_front();
    conn->receive_paused = false;
    if (conn->ending()) continue;
    if (after_decode(conn, status)) update_events(*conn);
  }
}

bool Backend::after_decode(const std::shared_ptr<Connection>& conn, FrameDecoder::Status status) {
  if (conn->reserved > 0 && !conn->decoder.in_body()) release_receive_memory(*conn);
  switch (status) {
    case FrameDecoder::Status::OK:
      return true;
    case FrameDecoder::Status::ERROR:
      if (conn->decoder.refused_address_in_use() && conn->phase == Phase::HANDSHAKE &&
          reconnect_from_new_source_port(conn)) {
        return false;
      }
      NETIO3_WARN("asyncmsg: closing connection with {}: {}", conn->remote, conn->decoder.error());
      close(conn, conn->decoder.error(), CloseCause::ERROR);
      return false;
    case FrameDecoder::Status::STOPPED:
      return false;
    case FrameDecoder::Status::PAUSED:
      pause_receiving(conn);
      return false;
  }
  return false;
}

void Backend::flush(const std::shared_ptr<Connection>& conn) {
  std::array<iovec, MAX_IOV> iov{};
  std::vector<detail::SendLedger::Ticket> finished;
  std::vector<detail::PendingSend> finished_sends;
  for (int round = 0; round < WRITES_PER_FLUSH; ++round) {
    std::size_t count = 0;
    {
      const std::lock_guard lock{conn->mutex};
      if (conn->ending()) return;
      // Once the application asked to close, nothing more is handed to the kernel: what
      // was queued at that moment is reported as cancelled, deterministically.
      if (!conn->close_requested.load(std::memory_order_relaxed)) {
        count = conn->queue.gather(iov.data(), iov.size(), MAX_WRITE_BYTES);
      }
      if (count == 0) conn->flush_pending = false;
    }
    if (count == 0) {
      set_epollout(*conn, false);
      return;
    }
    msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = count;
    const ssize_t n = ::sendmsg(conn->socket.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        set_epollout(*conn, true);
        return;
      }
      NETIO3_WARN("asyncmsg: connection with {}: send failed: {}", conn->remote, errno_text(err));
      close(conn, fmt::format("send failed: {}", errno_text(err)), CloseCause::ERROR);
      return;
    }
    finished.clear();
    finished_sends.clear();
    {
      const std::lock_guard lock{conn->mutex};
      conn->queue.consume(static_cast<std::size_t>(n), finished);
      for (const auto ticket : finished) {
        detail::PendingSend done;
        if (conn->ledger.complete(ticket, done)) finished_sends.push_back(done);
      }
    }
    for (const auto& done : finished_sends) {
      if (!completed(*conn, done)) return;
    }
  }
  // Still data after a full round: give other connections a turn, come back soon.
  request_flush(conn);
}

void Backend::linger(Connection& conn) {
  boost::system::error_code ec;
  const int fd = conn.socket.release(ec);
  if (ec) {
    drain_and_close(conn.socket);
    return;
  }
  m_lingering->add(detail::Socket{fd});
}

}  // namespace netio3::asyncmsg
