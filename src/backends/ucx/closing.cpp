// UCX backend: a connection's close, step by step (see the class's closing section).

#include "backends/ucx/ucx_backend_impl.hpp"

namespace netio3::ucx {

void Backend::close_transport(const std::shared_ptr<Connection>& conn) {
  m_closing.emplace(conn->id, conn);  // kept until UCX is done with it
  const auto& ending = conn->ending_info;
  // What arrived but was not delivered is dropped; receives in flight finish first.
  for (auto& slot : conn->inbox) discard(*conn, slot);
  if (ending.cause == CloseCause::LOCAL && ending.was_open) {
    // BYE ends the stream on UCX; CLOSE on the control channel says how many messages
    // to expect, which also covers a BYE that could not be sent.
    const auto bye = send_control(*conn, MessageType::BYE);
    if (bye != UCS_OK) {
      NETIO3_DEBUG("ucx: connection with {}: BYE not sent: {}", conn->remote, status_text(bye));
    }
    if (conn->control.valid() && conn->control_out.empty() &&
        !detail::send_now(conn->control.get(), encode_close(sent(*conn)))) {
      drop_control(*conn);
    }
  }
  if (ending.cause == CloseCause::SILENT) {
    // The peer's control channel fell silent: its process, host or link is gone, and the
    // sends UCX holds for it would wait for close_timeout. The endpoint to it is closed by
    // force (after this close; it ends every connection with that worker, which shares its
    // fate), so that UCX lets go of them now.
    drop_control(*conn);
    std::shared_ptr<Endpoint> endpoint;
    {
      const std::lock_guard lock{conn->mutex};
      endpoint = conn->ep;
    }
    if (endpoint) {
      std::weak_ptr<Backend> weak = weak_from_this();
      m_loop->post([weak, endpoint, why = ending.reason] {
        if (auto self = weak.lock(); self && !self->shut_down())
          self->close_endpoint(endpoint, why);
      });
    }
  } else if (ending.cause == CloseCause::ERROR) {
    // A CLOSE all the same, so that the peer does not take the end of the control channel
    // for the death of this process (on_control_end), which would end its other connections.
    if (conn->control.valid() && conn->control_out.empty() && ending.was_open) {
      (void)detail::send_now(conn->control.get(), encode_close(sent(*conn)));
    }
    drop_control(*conn);
  } else {
    // After a local close with messages sent, the peer ends its side of the control channel
    // once it has them all; the shutdown waits for that before it lets go of the endpoint.
    linger_control(*conn, ending.cause == CloseCause::LOCAL && ending.was_open && sent(*conn) > 0);
  }
  NETIO3_DEBUG("ucx: closing connection with {} ({})", conn->remote, ending.reason);
  m_close_deadlines->track(conn);
  release_endpoint_if_done(conn);
}

bool Backend::quiescent(const Connection& conn) const {
  if (!conn.ep_released) return false;
  const std::lock_guard lock{conn.mutex};
  return (conn.requests == 0 || conn.ep_gone) && conn.completions_queued == 0;
}

std::uint64_t Backend::sent(const Connection& conn) {
  const std::lock_guard lock{conn.mutex};
  return conn.tx_seq;
}

void Backend::close_timed_out(const std::shared_ptr<Connection>& conn) {
  if (conn->phase != Phase::CLOSING || conn->ep_released) return;
  std::shared_ptr<Endpoint> endpoint;
  {
    const std::lock_guard lock{conn->mutex};
    endpoint = conn->ep;
    NETIO3_DEBUG(
        "ucx: connection with {}: closing for {} ms, {} send request(s) held by UCX, "
        "{} completion(s) to report",
        conn->remote, m_config.limits.close_timeout.count(), conn->requests,
        conn->completions_queued);
  }
  if (!endpoint) return;
  const auto idle = std::chrono::steady_clock::now() - endpoint->last_progress;
  if (idle < m_config.limits.close_timeout) {
    NETIO3_DEBUG(
        "ucx: connection with {}: sends still in flight after {} ms; the peer is "
        "taking data, waiting on",
        conn->remote, m_config.limits.close_timeout.count());
    m_close_deadlines->track(conn);
    return;
  }
  const auto why = fmt::format("the peer took no data for {} ms",
                               std::chrono::duration_cast<std::chrono::milliseconds>(idle).count());
  NETIO3_WARN(
      "ucx: connection with {}: {}; closing the endpoint to it by force, which ends "
      "every connection with that peer",
      conn->remote, why);
  close_endpoint(endpoint, why);
}

void Backend::peer_close_timed_out(const std::shared_ptr<Connection>& conn) {
  if ((conn->phase != Phase::HANDSHAKE && conn->phase != Phase::OPEN) || !conn->peer_total) {
    return;
  }
  const auto reason =
      fmt::format("the peer closed after sending {} messages, {} of them arrived within {} ms",
                  *conn->peer_total, conn->rx_next, m_config.limits.close_timeout.count());
  NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
  close(conn, reason, CloseCause::ERROR);
}

void Backend::advance_close(const std::shared_ptr<Connection>& conn) {
  release_endpoint_if_done(conn);
  if (!finish(conn)) return;
  release_if_idle(conn);
}

void Backend::release_endpoint_if_done(const std::shared_ptr<Connection>& conn) {
  if (conn->phase != Phase::CLOSING || conn->ep_released) return;
  {
    const std::lock_guard lock{conn->mutex};
    if ((conn->requests > 0 && !conn->ep_gone) || conn->completions_queued > 0) return;
  }
  release_endpoint(*conn);
}

void Backend::release_if_idle(const std::shared_ptr<Connection>& conn) {
  if (conn->phase != Phase::CLOSED) return;
  {
    const std::lock_guard lock{conn->mutex};
    if (conn->requests > 0) return;
  }
  if (conn->receiving > 0 || !m_closing.contains(conn->id)) return;
  m_registry.forget(conn->id);
  m_closing.erase(conn->id);
  for (auto& slot : conn->inbox) release(*conn, slot);
  conn->inbox.clear();
  conn->region_map = MemoryMap{};
  conn->send_map = MemoryMap{};
  unmap_staging(*conn);
}

}  // namespace netio3::ucx
