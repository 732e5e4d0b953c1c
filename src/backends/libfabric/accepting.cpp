// libfabric backend, the server's side of the set-up: connection requests, admission
// (docs/admission.md) and the accept hook, rejects.

#include "backends/libfabric/libfabric_backend_impl.hpp"

namespace netio3::libfabric {

void Backend::refuse_request(Domain& domain, const Listener* listener, fi_info* request) noexcept {
  const std::lock_guard lock{m_pep_mutex};
  if (listener != nullptr && listener->pep) {
    fi_reject(listener->pep.get(), request->handle, nullptr, 0);
  } else {
    discard_request(domain, request);
  }
}

void Backend::reject_request(const Listener& listener, fi_info* request, std::uint16_t flags,
                             std::span<const std::uint8_t> tail) noexcept {
  const std::size_t room =
      listener.cm_data_size > CM_DATA_SIZE ? listener.cm_data_size - CM_DATA_SIZE : 0;
  std::vector<std::uint8_t> data;
  try {
    data = encode_cm(CmData{.recv_buf_size = 0, .flags = flags},
                     tail.first(std::min(room, tail.size())));
  } catch (const std::bad_alloc&) {
    data.clear();  // rejected without data, below
  }
  const std::lock_guard lock{m_pep_mutex};
  if (!listener.pep) {  // released meanwhile (its port was taken by a new listen endpoint)
    discard_request(*listener.domain, request);
    return;
  }
  const int rc = fi_reject(listener.pep.get(), request->handle, data.data(), data.size());
  // The provider frees the request whether or not the peer hears of it, except where it
  // refuses the data (a size it does not carry): then without data.
  if (rc != 0 && !data.empty()) {
    NETIO3_DEBUG("libfabric: fi_reject with {} bytes of data failed: {}", data.size(),
                 fi_error(rc));
    fi_reject(listener.pep.get(), request->handle, nullptr, 0);
  }
}

void Backend::discard_request(Domain& domain, fi_info* request) noexcept {
  // A request's handle has no operations of its own (fi_close on it would crash the tcp and
  // verbs providers): an endpoint takes it over, and closing that frees it.
  fid_ep* ep = nullptr;
  if (fi_endpoint(domain.domain(), request, &ep, nullptr) == 0) {
    fi_close(&ep->fid);
  } else {
    NETIO3_DEBUG(
        "libfabric: a connection request of a released listen endpoint is left to "
        "the provider");
  }
}

void Backend::on_connection_request(Domain& domain, const fi_eq_cm_entry& entry,
                                    std::span<const std::uint8_t> data) {
  Info info{entry.info};  // ours to free
  const auto listener = m_registry.listener_by_id(id_of(entry.fid));
  // A request for a closed listener is refused at once (the peer does not wait for its
  // set-up to time out, and the provider frees the request's socket).
  const auto refuse_closed = [&] {
    refuse_request(domain, listener.get(), info.get());
    NETIO3_DEBUG("libfabric: refused a connection request on a closed listen endpoint");
  };
  if (!listener || listener->closed.load()) {
    refuse_closed();
    return;
  }
  const auto reject = [&](std::string_view why, std::uint16_t flags = 0) {
    NETIO3_WARN("libfabric: refusing a connection on {}: {}", listener->address, why);
    reject_request(*listener, info.get(), flags, {});
  };
  std::string error;
  const auto peer = decode_cm_data(data, error);
  if (!peer) {
    reject(error);
    return;
  }
  const auto remote = detail::to_endpoint_address(info->dest_addr, info->dest_addrlen);
  if (!remote) {
    reject("the request carries no IP address");
    return;
  }
  // Admission, before the connection exists: no endpoint, no buffer for a refused peer.
  std::vector<std::uint8_t> accept_tail;
  const bool gated = !m_key.empty() || m_config.on_accept_cb || (peer->flags & CM_KEYED) != 0;
  if (gated && !admit_request(listener, info.get(), *peer, cm_tail(data), *remote, accept_tail)) {
    return;
  }
  std::shared_ptr<Connection> conn;
  {
    const auto held = m_registry.lock();
    // Closed meanwhile (also inside the accept hook; a new listener may have its port).
    if (!m_registry.has_listener(held, listener->address) || listener->closed.load()) {
      refuse_closed();
      return;
    }
    if (m_registry.find(held, *remote)) {
      // A source-port collision (docs/semantics.md): the flag tells a netio3 client to
      // connect from another port.
      reject(fmt::format("a connection from {} exists (a source-port collision: the client "
                         "should connect from another port)",
                         *remote),
             CM_REFUSED_ADDRESS_IN_USE);
      return;
    }
    try {
      conn = make_connection(*remote, listener->params, listener->id, domain, Phase::HANDSHAKE,
                             listener->shared_recv ? listener->shared_recv : global_recv(domain));
      if (!take_peer_cm_data(*conn, *peer)) {
        throw std::runtime_error(std::string{detail::PEER_CANNOT_ACKNOWLEDGE});
      }
      open_endpoint(*conn, info.get());
    } catch (const std::exception& e) {
      reject(e.what());
      return;
    }
    m_registry.index(conn);
    m_registry.add_connection(held, conn);
  }
  track_setup(conn);
  CmData own = own_cm_data(*conn);
  if (!m_key.empty()) own.flags |= CM_KEYED;  // the server's proof follows
  const auto reply = encode_cm(own, accept_tail);
  const int rc = fi_accept(conn->ep.get(), reply.data(), reply.size());
  if (rc != 0) {
    close(conn, fmt::format("fi_accept failed: {}", fi_error(rc)), CloseCause::ERROR);
    return;
  }
  NETIO3_DEBUG("libfabric: accepting connection from {} on {}", *remote, listener->address);
}

// ---- admission ------------------------------------------------------------------------

bool Backend::admit_request(const std::shared_ptr<Listener>& listener, fi_info* request,
                            const CmData& peer, std::span<const std::uint8_t> tail,
                            const EndPointAddress& remote, std::vector<std::uint8_t>& accept_tail) {
  const auto refuse_it = [&](std::string_view reason, std::string_view for_client = {}) {
    return not_admitted(*listener, request, remote, reason,
                        for_client.empty() ? reason : for_client);
  };
  const bool keyed_peer = (peer.flags & CM_KEYED) != 0;
  if (m_key.empty()) {
    if (keyed_peer) {
      // The client is told what its own side would have found: the same words on every
      // backend (asyncmsg and UCX find it in the greetings).
      return refuse_it(detail::PEER_REQUIRES_KEY, detail::PEER_HOLDS_NO_KEY);
    }
    return decide(listener, request, remote, {}, false);
  }
  if (!keyed_peer) {
    return refuse_it(detail::PEER_HOLDS_NO_KEY, detail::PEER_REQUIRES_KEY);
  }
  const auto now = ChallengeTable::Clock::now();
  if ((peer.flags & CM_PROOF) == 0) {
    // The first request: a challenge goes back with the rejection.
    auto keyed = decode_keyed_request(tail);
    if (!keyed) {
      return refuse_it(
          fmt::format("a keyed request whose {} bytes of admission data are no nonce and identity",
                      tail.size()));
    }
    const auto challenge = m_challenges.issue(listener->id, remote.address, std::move(*keyed),
                                              m_config.limits.connect_timeout, now);
    reject_request(*listener, request, CM_CHALLENGE, encode(challenge));
    NETIO3_DEBUG("libfabric: sent a challenge to {} on {}", remote, listener->address);
    return false;
  }
  const auto answer = decode_proof_request(tail);
  if (!answer) {
    return refuse_it(
        fmt::format("an answer to a challenge of {} bytes (24 expected)", tail.size()));
  }
  const auto entry = m_challenges.take(answer->id, remote.address, now);
  if (!entry || entry->listener != listener->id) {
    return refuse_it(
        "the peer answered no pending challenge of its address (a replayed set-up, or an "
        "answer later than limits.connect_timeout)");
  }
  if (!m_key.verify(ADMISSION_PROTOCOL, detail::AdmissionRole::CLIENT, entry->server, entry->client,
                    entry->identity, answer->proof)) {
    return refuse_it(
        "the peer failed to prove the partition key (another key, or a replayed set-up)");
  }
  if (!decide(listener, request, remote, entry->identity, true)) return false;
  const auto proof = m_key.prove(ADMISSION_PROTOCOL, detail::AdmissionRole::SERVER, entry->client,
                                 entry->server, m_config.identity);
  accept_tail = encode(ServerProof{short_proof(proof), m_config.identity});
  return true;
}

bool Backend::decide(const std::shared_ptr<Listener>& listener, fi_info* request,
                     const EndPointAddress& remote, std::string identity, bool key_proven) {
  if (!m_config.on_accept_cb) return true;
  const PeerInfo peer{.remote = remote,
                      .listener = listener->address,
                      .identity = std::move(identity),
                      .key_proven = key_proven};
  {
    const std::lock_guard lock{m_pep_mutex};
    m_deciding = Deciding{listener, request};
  }
  const AcceptDecision decision = detail::run_accept_hook(m_config.on_accept_cb, peer, NAME);
  if (shut_down()) return false;  // the shutdown refused the request
  bool answered = false;
  {
    const std::lock_guard lock{m_pep_mutex};
    answered = m_deciding && m_deciding->answered;
    m_deciding.reset();
  }
  if (answered) {
    NETIO3_DEBUG("libfabric: the listen endpoint {} went while its hook decided about {}",
                 listener->address, remote);
    return false;
  }
  if (!decision.admit)
    return not_admitted(*listener, request, remote, decision.reason, decision.reason);
  return true;
}

bool Backend::not_admitted(const Listener& listener, fi_info* request,
                           const EndPointAddress& remote, std::string_view reason,
                           std::string_view for_client) {
  NETIO3_WARN("libfabric: refusing connection from {} on {}: {}", remote, listener.address, reason);
  const auto text = detail::encode_refusal(for_client);
  reject_request(listener, request, CM_NOT_ADMITTED, text);
  return false;
}

}  // namespace netio3::libfabric
