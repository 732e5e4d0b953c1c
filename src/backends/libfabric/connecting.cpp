// libfabric backend, the client's side of the set-up: the answer to a connection request
// (established, refused, another source port, a challenge to answer) and the server's proof.

#include "backends/libfabric/libfabric_backend_impl.hpp"

namespace netio3::libfabric {

void Backend::on_eq_error(Domain& domain, const fi_eq_err_entry& err) {
  std::string why = fi_strerror(err.err);
  // The provider's own words, where it has some (for prov_errno 0 they read "Success").
  if (err.prov_errno != 0) {
    std::array<char, 256> detail_text{};
    const char* detail = fi_eq_strerror(domain.eq(), err.prov_errno, err.err_data,
                                        detail_text.data(), detail_text.size());
    if (detail != nullptr && *detail != '\0') why = fmt::format("{}: {}", why, detail);
  }
  auto refusal = RefusalCause::SETUP_FAILED;
  // What the reject data ask of the connection, once it is known: a refusal, another source
  // port, or the second request of the partition key's challenge.
  enum class Then : std::uint8_t { REFUSE, OTHER_SOURCE_PORT, ANSWER_CHALLENGE };
  Then then = Then::REFUSE;
  std::optional<Challenge> challenge;
  if (err.err == FI_ECONNREFUSED) {
    // A netio3 listener that says no sends its connection data with the refusal; a closed
    // port (or a closed listener) sends none.
    std::string ignored;
    const std::span<const std::uint8_t> reject_data =
        err.err_data != nullptr
            ? std::span{static_cast<const std::uint8_t*>(err.err_data), err.err_data_size}
            : std::span<const std::uint8_t>{};
    const auto data = reject_data.size() >= CM_DATA_MIN_SIZE ? decode_cm_data(reject_data, ignored)
                                                             : std::nullopt;
    if (!data) {
      refusal = RefusalCause::UNREACHABLE;
      why += " (nothing listens there, or its listen endpoint was closed)";
    } else if ((data->flags & CM_REFUSED_ADDRESS_IN_USE) != 0) {
      then = Then::OTHER_SOURCE_PORT;
      refusal = RefusalCause::REJECTED;
      why = "refused by the peer: it has a connection from this source address and port already";
    } else if ((data->flags & CM_NOT_ADMITTED) != 0) {
      refusal = RefusalCause::NOT_ADMITTED;
      const std::string text = detail::decode_refusal(cm_tail(reject_data));
      why = text == detail::PEER_HOLDS_NO_KEY || text == detail::PEER_REQUIRES_KEY
                ? text
                : fmt::format("refused by the server: {}", text);
    } else if ((data->flags & CM_CHALLENGE) != 0) {
      then = Then::ANSWER_CHALLENGE;
      challenge = decode_challenge(cm_tail(reject_data));
    } else {
      refusal = RefusalCause::REJECTED;
      why = "refused by the peer (its log says why)";
    }
  } else if (err.err == FI_ETIMEDOUT) {
    refusal = RefusalCause::TIMED_OUT;
  } else if (err.err == FI_EHOSTUNREACH || err.err == FI_ENETUNREACH) {
    refusal = RefusalCause::UNREACHABLE;
  }
  if (auto conn = m_registry.by_id(id_of(err.fid))) {
    if (then == Then::OTHER_SOURCE_PORT && conn->phase == Phase::CONNECTING &&
        reconnect_from_new_source_port(conn)) {
      return;
    }
    if (then == Then::ANSWER_CHALLENGE) {
      (void)answer_challenge(conn, challenge);
      return;
    }
    if (conn->setting_up() && refusal == RefusalCause::SETUP_FAILED) {
      why += " (the connection broke off during the provider's set-up)";
    }
    // As the other backends' clients do: a refusal by admission is worth a line of its own.
    if (refusal == RefusalCause::NOT_ADMITTED) {
      NETIO3_WARN("libfabric: connection to {} not admitted: {}", conn->remote, why);
    }
    refuse(conn, refusal, why);
    return;
  }
  NETIO3_DEBUG("libfabric: event queue error for no known endpoint: {}", why);
}

bool Backend::reconnect_from_new_source_port(const std::shared_ptr<Connection>& old) {
  if (!detail::retry_from_new_source_port(*old, NAME)) return false;
  // A keyed client starts its admission over: the server took the challenge with the second
  // request it refused.
  if (old->admission) *old->admission = Connection::ClientAdmission{detail::make_nonce()};
  return connect_again(old);
}

bool Backend::connect_again(const std::shared_ptr<Connection>& old) {
  const auto fail = [](const std::string& why) { return std::runtime_error(why); };
  std::shared_ptr<Connection> conn;
  Info info;
  try {
    info = fabric_info(old->remote, false, fail);
    Domain& domain = open_domain(*info, fail);
    conn = make_connection(old->remote, old->params, 0, domain, Phase::CONNECTING,
                           global_recv(domain));
    const detail::Socket reservation = reserve_source_port(info.get());
    open_endpoint(*conn, info.get());
  } catch (const std::exception& e) {
    NETIO3_WARN("libfabric: connecting again to {}: {}", old->remote, e.what());
    if (conn) retire_unregistered(conn);
    return false;
  }
  conn->source_port_retries = old->source_port_retries;
  conn->admission = old->admission;
  // Buffers the application took from the old endpoint's own pool stay valid: the new
  // endpoint takes the pool over, with its registration.
  if (conn->domain == old->domain) {
    const std::lock_guard old_lock{old->mutex};
    const std::lock_guard lock{conn->mutex};
    std::swap(old->own_send_pool, conn->own_send_pool);
    std::swap(old->send_mr, conn->send_mr);
    std::swap(old->send_desc, conn->send_desc);
    if (conn->own_send_pool) conn->send_pool = conn->own_send_pool.get();
    if (old->own_send_pool) old->send_pool = old->own_send_pool.get();
  }
  m_registry.index(conn);
  bool replaced = false;
  {
    const auto held = m_registry.lock();
    replaced = m_registry.replace_connection(held, old, conn);
  }
  if (!replaced) {  // closed by the application meanwhile: that close reports it
    m_registry.forget(conn->id);
    retire_unregistered(conn);
    return false;
  }
  conn->setup_deadline = old->setup_deadline;
  track_setup(conn, conn->setup_deadline);
  close(old, "superseded", CloseCause::ERROR, false);
  const auto data = connect_data(*conn);
  const int rc = fi_connect(conn->ep.get(), info->dest_addr, data.data(), data.size());
  if (rc != 0) {
    // Reported from the loop, after the event being handled.
    refuse_later(conn, RefusalCause::UNREACHABLE,
                 fmt::format("fi_connect failed: {}", fi_error(rc)));
  }
  return true;
}

void Backend::on_connected(const std::shared_ptr<Connection>& conn,
                           std::span<const std::uint8_t> data) {
  if (conn->phase == Phase::CONNECTING) {
    std::string error;
    const auto peer = decode_cm_data(data, error);
    if (!peer) {
      NETIO3_WARN("libfabric: connection with {}: {}", conn->remote, error);
      close(conn, error, CloseCause::ERROR);
      return;
    }
    if (conn->admission && !server_proved(conn, *peer, cm_tail(data))) return;
    if (!take_peer_cm_data(*conn, *peer)) {
      NETIO3_WARN("libfabric: connection with {}: {}", conn->remote,
                  detail::PEER_CANNOT_ACKNOWLEDGE);
      refuse(conn, RefusalCause::SETUP_FAILED, detail::PEER_CANNOT_ACKNOWLEDGE);
      return;
    }
  }
  if (conn->setting_up()) (void)established(conn, capabilities(*conn));
}

bool Backend::answer_challenge(const std::shared_ptr<Connection>& conn,
                               const std::optional<Challenge>& challenge) {
  std::string_view problem;
  if (!conn->admission) {
    problem = "the server sent a challenge to a client without a partition key";
  } else if (conn->admission->challenge) {
    problem = "the server answered the proof with another challenge";
  } else if (!challenge) {
    problem = "the server's challenge is malformed";
  } else if (conn->phase != Phase::CONNECTING) {
    problem = "a challenge after the set-up";
  }
  if (problem.empty()) {
    // Closed by the application meanwhile: its posted close ends it.
    if (conn->close_requested.load()) return false;
    conn->admission->challenge = challenge;
    if (connect_again(conn)) return true;
    refuse(conn, RefusalCause::SETUP_FAILED,
           "the second connection request of the partition key's challenge could not be made "
           "(the log says why)");
    return false;
  }
  NETIO3_WARN("libfabric: connection to {} not admitted: {}", conn->remote, problem);
  refuse(conn, RefusalCause::NOT_ADMITTED, problem);
  return false;
}

bool Backend::server_proved(const std::shared_ptr<Connection>& conn, const CmData& peer,
                            std::span<const std::uint8_t> tail) {
  const auto& admission = *conn->admission;
  std::string_view problem;
  if ((peer.flags & CM_KEYED) == 0) {
    problem = "the server holds no partition key (it accepted without a proof)";
  } else if (!admission.challenge) {
    problem = "the server accepted without a challenge";
  } else {
    const auto proof = decode_server_proof(tail);
    if (!proof || !m_key.verify(ADMISSION_PROTOCOL, detail::AdmissionRole::SERVER, admission.nonce,
                                admission.challenge->nonce, proof->identity, proof->proof)) {
      problem = "the server failed to prove the partition key";
    }
  }
  if (problem.empty()) return true;
  NETIO3_WARN("libfabric: connection to {} not admitted: {}", conn->remote, problem);
  refuse(conn, RefusalCause::NOT_ADMITTED, problem);
  return false;
}

}  // namespace netio3::libfabric
