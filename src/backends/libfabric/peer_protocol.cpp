// libfabric backend: what two netio3 sides agree on in their connection data (receive size,
// heartbeats, tagged data, goodbyes, acknowledgements: fabric.hpp), and the messages that
// carry no data - heartbeats, goodbyes and acknowledgements.

#include "backends/libfabric/libfabric_backend_impl.hpp"
#include "common/byte_order.hpp"

namespace netio3::libfabric {

void Backend::on_control(Op& op, std::uint64_t token, std::size_t len) {
  Connection* conn = op.conn;
  std::shared_ptr<Connection> named;
  if (conn == nullptr) {  // a shared receive context: the token names the connection
    named = m_registry.by_id(token);
    conn = named.get();
  }
  std::optional<std::uint64_t> ack;
  if (conn != nullptr) {
    ++conn->arrivals;
    if (len == GOODBYE_SIZE) conn->goodbye_received = true;
    if (len == ACK_SIZE) ack = detail::load_le64(op.buffer->data());
  }
  // The buffer goes back before the acknowledgement's callbacks run (they may close).
  if (op.conn == nullptr) {
    repost_shared(op);
  } else if (still_open(*conn)) {
    repost(op, *conn);
  }
  if (!ack || !still_open(*conn)) return;
  if (!named) named = m_registry.by_id(conn->id);
  if (named) (void)acknowledgement(named, *ack);
}

bool Backend::send_ack(const std::shared_ptr<Connection>& conn, std::uint64_t count) {
  std::array<std::uint8_t, ACK_SIZE> body{};
  detail::store_le64(body.data(), count);
  ssize_t rc = 0;
  {
    const std::lock_guard lock{conn->mutex};
    if (conn->phase != Phase::OPEN || !conn->ep) return true;
    // As a heartbeat: injected, no completion; the entry make_connection leaves for them, or
    // a data send's once it completed (-FI_EAGAIN: again next round).
    rc = fi_injectdata(conn->ep.get(), body.data(), body.size(), conn->peer_heartbeat_token, 0);
  }
  if (rc == -FI_EAGAIN) return false;
  if (rc != 0) {
    // The endpoint failed: its error closes the connection, and the peer's close lists what
    // this side did not acknowledge.
    NETIO3_DEBUG("libfabric: acknowledgement to {} not sent: {}", conn->remote, fi_error(rc));
  }
  return true;
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
  std::uint16_t flags = heartbeats ? CM_SENDS_HEARTBEATS | CM_GOODBYE | CM_ACKS : std::uint16_t{0};
  if (token != 0 && conn.recv->srx) flags |= CM_TAG_DATA;
  if (conn.params.delivery.acknowledged) flags |= CM_ACK_WANTED;
  return CmData{.recv_buf_size = receive_size(conn), .flags = flags, .heartbeat_token = token};
}

bool Backend::take_peer_cm_data(Connection& conn, const CmData& peer) {
  const CmData own = own_cm_data(conn);
  // Acknowledgements travel as heartbeats do: to the receiver of the acknowledged messages,
  // addressed by its token.
  conn.acks.peer_wants_acks =
      (peer.flags & CM_ACK_WANTED) != 0 && peer.heartbeat_token != 0 && (own.flags & CM_ACKS) != 0;
  const bool peer_acknowledges = (peer.flags & CM_ACKS) != 0 && own.heartbeat_token != 0;
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
  return !conn.params.delivery.acknowledged || peer_acknowledges;
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
