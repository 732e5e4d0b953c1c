// libfabric backend: what two netio3 sides agree on in their connection data (receive size,
// heartbeats, tagged data, goodbyes: fabric.hpp), and the messages that carry no data -
// heartbeats and goodbyes.

#include "backends/libfabric/libfabric_backend_impl.hpp"

namespace netio3::libfabric {

void Backend::on_heartbeat(Op& op, std::uint64_t token, bool goodbye) {
  Connection* conn = op.conn;
  if (conn == nullptr) {  // a shared receive context: the token names the connection
    if (const auto named = m_registry.by_id(token)) {
      ++named->arrivals;
      if (goodbye) named->goodbye_received = true;
    }
    repost_shared(op);
    return;
  }
  ++conn->arrivals;
  if (goodbye) conn->goodbye_received = true;
  if (still_open(*conn)) repost(op, *conn);
}

void Backend::say_goodbye(Connection& conn) noexcept {
  static constexpr std::array<std::uint8_t, GOODBYE_SIZE> GOODBYE{'G'};
  if (!conn.peer_takes_goodbye || !conn.ep) return;
  // The entry make_connection leaves for heartbeats; when a heartbeat holds it the peer reads
  // a lost peer.
  const ssize_t rc =
      fi_injectdata(conn.ep.get(), GOODBYE.data(), GOODBYE.size(), conn.peer_heartbeat_token, 0);
  if (rc != 0) {
    NETIO3_DEBUG("libfabric: goodbye to {} not sent: {}", conn.remote, fi_error(rc));
  }
}

void Backend::send_heartbeat(const std::shared_ptr<Connection>& conn) {
  static constexpr std::uint8_t NOTHING = 0;
  ssize_t rc = 0;
  {
    const std::lock_guard lock{conn->mutex};
    if (conn->close_requested.load(std::memory_order_relaxed) || conn->phase != Phase::OPEN) {
      return;
    }
    // No completion, no context: nothing of ours for the provider to hold. make_connection
    // leaves one entry of the transmit queue for it.
    rc = fi_injectdata(conn->ep.get(), &NOTHING, 0, conn->peer_heartbeat_token, 0);
  }
  if (rc != 0) {
    NETIO3_DEBUG("libfabric: heartbeat to {} not sent now: {}", conn->remote, fi_error(rc));
  }
}

CmData Backend::own_cm_data(const Connection& conn) {
  const std::size_t bytes = conn.domain->cq_data_size();
  const bool heartbeats = bytes >= sizeof(std::uint32_t);
  // The token must fit the CQ data (verbs: 4 bytes) below its tag bit; connection ids count
  // from 1.
  const bool fits = conn.id < cq_tag_bit(bytes);
  const std::uint64_t token = heartbeats && fits && conn.recv ? conn.id : 0;
  std::uint16_t flags = heartbeats ? CM_SENDS_HEARTBEATS | CM_GOODBYE : std::uint16_t{0};
  if (token != 0 && conn.recv->srx) flags |= CM_TAG_DATA;
  return CmData{.recv_buf_size = receive_size(conn), .flags = flags, .heartbeat_token = token};
}

void Backend::take_peer_cm_data(Connection& conn, const CmData& peer) {
  const CmData own = own_cm_data(conn);
  conn.peer_sends_heartbeats = (peer.flags & CM_SENDS_HEARTBEATS) != 0 && own.heartbeat_token != 0;
  conn.peer_takes_heartbeats = peer.heartbeat_token != 0 && (own.flags & CM_SENDS_HEARTBEATS) != 0;
  const bool goodbyes = (peer.flags & CM_GOODBYE) != 0 && (own.flags & CM_GOODBYE) != 0;
  conn.peer_says_goodbye = goodbyes && own.heartbeat_token != 0;
  const std::lock_guard lock{conn.mutex};
  conn.peer_takes_goodbye = goodbyes && peer.heartbeat_token != 0;
  conn.peer_recv_size = peer.recv_buf_size;
  conn.peer_heartbeat_token = peer.heartbeat_token;
  conn.data_tag = (peer.flags & CM_TAG_DATA) != 0 && peer.heartbeat_token != 0
                      ? peer.heartbeat_token | cq_tag_bit(conn.domain->cq_data_size())
                      : 0;
}

std::vector<std::uint8_t> Backend::connect_data(const Connection& conn) const {
  CmData own = own_cm_data(conn);
  if (!conn.admission) return encode_cm(own, {});
  const auto& admission = *conn.admission;
  own.flags |= CM_KEYED;
  if (!admission.challenge) {
    return encode_cm(own, encode(KeyedRequest{admission.nonce, m_config.identity}));
  }
  own.flags |= CM_PROOF;
  const auto proof = m_key.prove(ADMISSION_PROTOCOL, detail::AdmissionRole::CLIENT,
                                 admission.challenge->nonce, admission.nonce, m_config.identity);
  return encode_cm(own, encode(ProofRequest{admission.challenge->id, short_proof(proof)}));
}

}  // namespace netio3::libfabric
