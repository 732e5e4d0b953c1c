// libfabric backend: what the completion queue reports - messages received (into a
// connection's own buffers or a shared receive context), failed receives, finished sends.

#include "backends/libfabric/libfabric_backend_impl.hpp"

namespace netio3::libfabric {

void Backend::on_completion(const Domain& domain, const fi_cq_data_entry& entry) {
  auto* op = static_cast<Op*>(entry.op_context);
  if (op == nullptr) return;
  if (op->kind == Op::Kind::RECV) {
    op->recv->posted.fetch_sub(1, std::memory_order_relaxed);
    // Remote CQ data: a heartbeat, goodbye or acknowledgement (the token), or a tagged
    // message (the token and the tag bit: a shared receive context's, CM_TAG_DATA).
    if ((entry.flags & FI_REMOTE_CQ_DATA) != 0) [[unlikely]] {
      const std::uint64_t tag_bit = cq_tag_bit(domain.cq_data_size());
      if ((entry.data & tag_bit) != 0) {
        on_received(*op, entry.len, entry.data & ~tag_bit);
      } else {
        on_control(*op, entry.data, entry.len);
      }
      return;
    }
    on_received(*op, entry.len);
  } else {
    on_send_done(*op, true, {});
  }
}

void Backend::on_completion_error(Domain& domain, const fi_cq_err_entry& err) {
  auto* op = static_cast<Op*>(err.op_context);
  // The provider's own words only where it has some: for prov_errno 0 they read "Success",
  // and the tcp provider's errno-based ones ("Function not implemented") say nothing more.
  std::string why = fi_strerror(err.err);
  if (err.prov_errno != 0 && err.prov_errno != err.err) {
    std::array<char, 256> detail_text{};
    const char* detail = fi_cq_strerror(domain.cq(), err.prov_errno, err.err_data,
                                        detail_text.data(), detail_text.size());
    if (detail != nullptr && *detail != '\0') why = fmt::format("{} ({})", why, detail);
  }
  if (op == nullptr) {
    NETIO3_WARN("libfabric: completion error without context: {}", why);
    return;
  }
  if (op->kind == Op::Kind::SEND) {
    on_send_done(*op, false, why);
    return;
  }
  // A failed or cancelled receive.
  op->recv->posted.fetch_sub(1, std::memory_order_relaxed);
  if (err.err == FI_ECANCELED) return;  // its endpoint (or shared context) is closing
  Connection* conn = op->conn;
  if (conn == nullptr) {
    NETIO3_WARN("libfabric: receive into a shared buffer failed: {}", why);
    repost_shared(*op);
    return;
  }
  if (auto shared = m_registry.by_id(conn->id)) {
    const bool too_large = err.err == FI_ETRUNC;
    const auto reason =
        fmt::format("receive failed: {}{}", why,
                    too_large ? " (a message larger than the receive buffers)" : "");
    NETIO3_WARN("libfabric: connection with {}: {}", conn->remote, reason);
    // A message over the receive buffers' size is the peer's fault (it was told the size).
    close(shared, reason, too_large ? CloseCause::PROTOCOL : CloseCause::ERROR);
  }
}

void Backend::on_received(Op& op, std::size_t len, std::uint64_t token) {
  Connection* conn = op.conn;
  const std::span<const std::uint8_t> bytes{op.buffer->data(),
                                            std::min(len, op.buffer->capacity())};
  if (conn == nullptr) {
    // A shared receive context: the tag names the connection; a sender that does not tag
    // (an older netio3) leaves it unknown.
    if (token == 0) {
      m_notifier.data(SHARED_SOURCE, bytes);
    } else if (const auto named = m_registry.by_id(token)) {
      ++named->arrivals;
      // A connection that is closing delivers nothing more (as with its own buffers).
      if (still_open(*named)) (void)deliver(*named, bytes);
    } else {
      // Tokens are random (new_token): a peer on this shared context that names no
      // connection of ours guesses, or names one that has closed since.
      NETIO3_LOG_LIMITED(m_peer_log, LogLevel::warn,
                         "libfabric: dropped a message of {} bytes on a shared receive context: "
                         "its tag names no open connection (a closed one, or a peer that guesses)",
                         bytes.size());
    }
    if (!shut_down()) repost_shared(op);
    return;
  }
  ++conn->arrivals;
  // Closing: the buffer is not posted again.
  if (!still_open(*conn) || !deliver(*conn, bytes)) return;
  repost(op, *conn);
}

void Backend::repost(Op& op, Connection& conn) {
  try {
    post_receive(op, conn.ep.get());
  } catch (const std::runtime_error& e) {
    if (auto shared = m_registry.by_id(conn.id)) close(shared, e.what(), CloseCause::ERROR);
  }
}

void Backend::post_receive(Op& op, fid_ep* target) const {
  const ssize_t rc =
      fi_recv(target, op.buffer->data(), op.buffer->capacity(), op.recv->desc, 0, &op);
  if (rc != 0) {
    throw std::runtime_error(fmt::format("fi_recv failed: {}", fi_error(rc)));
  }
  op.recv->posted.fetch_add(1, std::memory_order_relaxed);
}

void Backend::repost_shared(Op& op) {
  try {
    post_receive(op, op.recv->srx.get());
  } catch (const std::runtime_error& e) {
    NETIO3_ERROR("libfabric: shared receive buffer lost: {}", e.what());
  }
}

void Backend::on_send_done(Op& op, bool ok, const std::string& why) {
  Connection& conn = *op.conn;
  detail::PendingSend done;
  bool done_now = false;
  {
    const std::lock_guard lock{conn.mutex};
    conn.unsent_bytes -= std::min<std::uint64_t>(conn.unsent_bytes, op.bytes);
    conn.free_send_ops.push_back(op.slot);
    if (ok) done_now = conn.ledger.complete(op.ticket, done);
  }
  if (!ok) {
    // The key is reported with the connection's cancelled keys; the connection is broken.
    if (!conn.ending()) {
      if (auto shared = m_registry.by_id(conn.id)) {
        NETIO3_WARN("libfabric: connection with {}: send failed: {}", conn.remote, why);
        close(shared, fmt::format("send failed: {}", why), CloseCause::ERROR);
      }
    }
    return;
  }
  if (done_now) (void)completed(conn, done);  // else cancelled by a close meanwhile
}

}  // namespace netio3::libfabric
