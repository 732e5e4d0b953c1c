// libfabric backend: closing a connection - a peer's shutdown once its messages were read,
// the goodbye and fi_shutdown of our own close, endpoints retired until the provider is done
// with them, listeners.

#include "backends/libfabric/libfabric_backend_impl.hpp"

namespace netio3::libfabric {

void Backend::close_shut_down_peers(Domain& domain) {
  if (domain.peer_shutdowns.empty()) return;
  const std::vector<std::uint64_t> ids = std::exchange(domain.peer_shutdowns, {});
  for (const std::uint64_t id : ids) {
    if (auto conn = m_registry.by_id(id)) {
      // Everything the peer sent before its end was read: a goodbye among it, if it sent one.
      if (conn->peer_says_goodbye && !conn->goodbye_received) {
        close(conn, detail::ENDED_WITHOUT_GOODBYE, CloseCause::ERROR);
      } else {
        close(conn, "peer closed the connection", CloseCause::PEER);
      }
    }
    if (shut_down()) return;
  }
}

void Backend::retire(const std::shared_ptr<Connection>& conn) {
  conn->ep.reset();
  m_retired.push_back(Retired{conn->domain, conn->domain->drains, conn});
}

void Backend::retire_unregistered(const std::shared_ptr<Connection>& conn) {
  {
    const std::lock_guard lock{conn->mutex};
    conn->phase = Phase::CLOSED;
  }
  retire(conn);
}

void Backend::close_transport(const std::shared_ptr<Connection>& conn) {
  m_registry.forget(conn->id);
  const auto& ending = conn->ending_info;
  if (conn->ep && ending.was_open &&
      (ending.cause == CloseCause::LOCAL || ending.cause == CloseCause::ERROR)) {
    if (ending.cause == CloseCause::LOCAL) {
      const std::lock_guard lock{conn->mutex};
      say_goodbye(*conn);
    }
    fi_shutdown(conn->ep.get(), 0);
  }
  retire(conn);
}

void Backend::close_listener(const std::shared_ptr<Listener>& listener) {
  listener->closed.store(true);
  m_closed_listeners->retire(listener);
}

void Backend::abandon(Connection& conn) noexcept {
  {
    const std::lock_guard lock{conn.mutex};
    if (conn.phase == Phase::OPEN && conn.ep) {
      // The backend is destroyed: an orderly end for the peer.
      say_goodbye(conn);
      fi_shutdown(conn.ep.get(), 0);
    }
    conn.phase = Phase::CLOSED;
    conn.ledger.cancel_all();
  }
  conn.ep.reset();
}

void Backend::release_listener(Listener& listener) {
  {
    const std::lock_guard lock{m_pep_mutex};
    // The request its accept hook is being asked about is answered now, while its passive
    // endpoint can: refused as for a closed listener (the hook's verdict is then ignored).
    if (m_deciding && !m_deciding->answered && m_deciding->listener.get() == &listener &&
        listener.pep) {
      fi_reject(listener.pep.get(), m_deciding->request->handle, nullptr, 0);
      m_deciding->answered = true;
    }
    listener.pep.reset();
  }
  m_registry.forget_listener(listener.id);
}

// A retired connection is freed when the provider holds none of its operations. The tcp,
// net and verbs providers of libfabric 1.17 turn an endpoint's posted operations into
// FI_ECANCELED completions inside fi_close (tcpx_ep_flush_all_queues, xnet_ep_flush_all_queues,
// vrb_flush_sq/vrb_flush_rq), so the count reaches zero within the next complete read of the
// queue. A provider that drops them instead never completes them: once the queue was read
// empty after the close, nothing of the endpoint can come any more, and it is freed then.
void Backend::release_retired(const Domain& domain) {
  std::erase_if(m_retired, [&](const Retired& r) {
    if (r.domain != &domain) return false;
    const std::size_t held = r.conn->provider_ops();
    if (held == 0) return true;
    if (domain.drains == r.drains_at_close) return false;
    NETIO3_DEBUG(
        "libfabric: the provider dropped {} operation(s) of the closed endpoint to {} "
        "without completing them",
        held, r.conn->remote);
    return true;
  });
}

}  // namespace netio3::libfabric
