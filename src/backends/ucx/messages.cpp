// UCX backend: sending, what UCX's callbacks record, and the loop that progresses the worker
// and delivers messages in order.

#include "backends/ucx/ucx_backend_impl.hpp"
#include "common/send_failure.hpp"

namespace netio3::ucx {

NetioStatus Backend::post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer) {
  const iovec iov{buffer->data(), buffer->size()};
  return send_message(*conn, {}, std::span{&iov, 1}, SendKind::BUFFERED,
                      detail::PendingSend{buffer->id(), buffer});
}

NetioStatus Backend::post_data(const std::shared_ptr<Connection>& conn,
                               std::span<const std::uint8_t> header, std::span<const iovec> iov,
                               Payload payload, detail::PendingSend pending) {
  return send_message(*conn, header, iov,
                      payload == Payload::COPY ? SendKind::COPY : SendKind::ZERO_COPY, pending);
}

NetioStatus Backend::send_message(Connection& conn, std::span<const std::uint8_t> header,
                                  std::span<const iovec> payload, SendKind kind,
                                  detail::PendingSend pending) {
  std::size_t size = header.size();
  for (const auto& v : payload) size += v.iov_len;
  if (payload.size() > MAX_IOV) {
    return detail::send_failed(SendFailureCause::INVALID,
                               fmt::format("ucx: send to {}: {} pieces exceed the limit of {}",
                                           conn.remote, payload.size(), MAX_IOV));
  }
  {
    const std::lock_guard lock{conn.mutex};
    if (conn.close_requested.load(std::memory_order_relaxed) || conn.ending()) {
      return detail::send_failed(
          SendFailureCause::CLOSING,
          fmt::format("ucx: send to {}: the connection is closing", conn.remote), false);
    }
    if (conn.phase != Phase::OPEN) return NetioStatus::NO_RESOURCES;  // still connecting
    if (size > conn.peer_max) {
      return detail::send_failed(
          SendFailureCause::TOO_LARGE,
          fmt::format("ucx: send to {}: a message of {} bytes exceeds the peer's limit of {} "
                      "bytes",
                      conn.remote, size, conn.peer_max));
    }
    // Sends that UCX took at once count until their completion is reported: a sender on
    // the loop thread whose peer keeps up would otherwise queue reports without bound.
    if (conn.unsent_bytes >= m_config.limits.max_unsent_bytes ||
        conn.data_ops + conn.completions_queued >= MAX_SEND_DEPTH) {
      return NetioStatus::NO_RESOURCES;
    }
    SendOp& op = take_op(conn);
    op.control = false;
    op.bytes = size;
    op.buffer = pending.buffer;
    const void* buffer = nullptr;
    std::size_t count = 0;
    ucp_mem_h memh = nullptr;
    ucp_datatype_t datatype = ucp_dt_make_contig(1);
    if (kind == SendKind::COPY) {
      if (op.staging_capacity < size) grow_staging(conn, op, size);
      memh = op.staging_map.get();
      std::uint8_t* out = op.staging.get();
      if (!header.empty()) out = std::copy(header.begin(), header.end(), out);
      for (const auto& v : payload) {
        if (v.iov_len > 0) std::memcpy(out, v.iov_base, v.iov_len);
        out += v.iov_len;
      }
      buffer = op.staging.get();
      count = size;
    } else if (payload.size() == 1) {
      // The header travels in the UCX header (the prefix): the payload is one contiguous
      // block from registered memory, so UCX may send it zero-copy / by rendezvous.
      buffer = payload[0].iov_base;
      count = payload[0].iov_len;
      memh = kind == SendKind::BUFFERED ? conn.send_memh : conn.region_map.get();
    } else if (!payload.empty()) {
      std::size_t n = 0;
      for (const auto& v : payload) op.iov.at(n++) = ucp_dt_iov_t{v.iov_base, v.iov_len};
      buffer = op.iov.data();
      count = n;
      datatype = ucp_dt_make_iov();
    }
    const auto prefix = kind == SendKind::COPY ? std::span<const std::uint8_t>{} : header;
    op.ticket = conn.ledger.add(pending);
    const ucs_status_t status =
        post(conn, op, MessageType::DATA, buffer, count, datatype, memh, prefix);
    if (status == UCS_INPROGRESS) {
      ++conn.data_ops;
      conn.unsent_bytes += size;
    } else if (status == UCS_OK) {
      // Gone at once: completed now, reported from the loop. The close is reported only
      // once every such completion has been (quiescent() waits for completions_queued).
      // (An acknowledged send ends later, with the peer's acknowledgement.)
      detail::PendingSend done;
      const bool ended = conn.ledger.complete(op.ticket, done);
      release_op(conn, op);
      if (ended) {
        ++conn.completions_queued;
        push_event(Event{.kind = Event::Kind::SENT_AT_ONCE,
                         .conn = std::static_pointer_cast<Connection>(conn.shared_from_this()),
                         .key = done.key,
                         .buffer = done.buffer});
      }
    } else {
      conn.ledger.retract(op.ticket);
      release_op(conn, op);
      if (status == UCS_ERR_NO_RESOURCE) return NetioStatus::NO_RESOURCES;
      return detail::send_failed(
          SendFailureCause::TRANSPORT,
          fmt::format("ucx: send to {} failed: {}", conn.remote, status_text(status)));
    }
  }
  NETIO3_TRACE("ucx: send to {} key={} size={}", conn.remote, pending.key, size);
  // On the loop thread the prepare hook reports it before the loop sleeps; from another
  // thread the loop must wake up (and progress the send, or report its completion).
  if (!m_loop->in_loop_thread()) kick();
  return NetioStatus::OK;
}

bool Backend::send_ack(const std::shared_ptr<Connection>& conn, std::uint64_t count) {
  std::array<std::uint8_t, ACK_PREFIX_SIZE> prefix{};
  detail::store_le64(prefix.data(), count);
  const ucs_status_t status = send_control(*conn, MessageType::ACK, prefix);
  if (status == UCS_ERR_NO_RESOURCE) return false;
  if (status != UCS_OK) {
    // The endpoint failed or is closing: its error closes the connection; the peer's close
    // lists what this side did not acknowledge.
    NETIO3_DEBUG("ucx: acknowledgement to {} not sent: {}", conn->remote, status_text(status));
  }
  return true;
}

ucs_status_t Backend::send_control(Connection& conn, MessageType type,
                                   std::span<const std::uint8_t> prefix) {
  const std::lock_guard lock{conn.mutex};
  if (conn.free_ops.empty() && conn.ops.size() >= MAX_SEND_DEPTH + CONTROL_OPS) {
    return UCS_ERR_NO_RESOURCE;
  }
  SendOp& op = take_op(conn);
  op.control = true;
  op.bytes = 0;
  op.buffer = nullptr;
  const ucs_status_t status =
      post(conn, op, type, nullptr, 0, ucp_dt_make_contig(1), nullptr, prefix);
  if (status != UCS_INPROGRESS) release_op(conn, op);
  return status == UCS_INPROGRESS ? UCS_OK : status;
}

SendOp& Backend::take_op(Connection& conn) {
  if (conn.free_ops.empty()) {
    SendOp& op = conn.ops.emplace_back();
    op.conn = &conn;
    op.slot = static_cast<std::uint32_t>(conn.ops.size() - 1);
    return op;
  }
  const std::uint32_t slot = conn.free_ops.back();
  conn.free_ops.pop_back();
  return conn.ops[slot];
}

void Backend::release_op(Connection& conn, SendOp& op) {
  if (op.staging_capacity > 0 && conn.staging_bytes > STAGING_BUDGET) free_staging(conn, op);
  conn.free_ops.push_back(op.slot);
}

void Backend::free_staging(Connection& conn, SendOp& op) {
  conn.staging_bytes -= op.staging_capacity;
  op.staging_map = MemoryMap{};
  op.staging.reset();
  op.staging_capacity = 0;
}

void Backend::unmap_staging(Connection& conn) {
  const std::lock_guard lock{conn.mutex};
  for (auto& op : conn.ops) op.staging_map = MemoryMap{};
}

void Backend::grow_staging(Connection& conn, SendOp& op, std::size_t size) {
  free_staging(conn, op);
  op.staging = std::make_unique_for_overwrite<std::uint8_t[]>(size);
  op.staging_capacity = size;
  conn.staging_bytes += size;
  if (size < STAGING_MAP_MIN) return;
  try {
    op.staging_map = MemoryMap{m_worker->context(), {op.staging.get(), size}};
  } catch (const std::exception& e) {
    NETIO3_DEBUG("ucx: copy sends to {}: staging memory stays unmapped: {}", conn.remote, e.what());
  }
}

ucs_status_t Backend::post(Connection& conn, SendOp& op, MessageType type, const void* buffer,
                           std::size_t count, ucp_datatype_t datatype, ucp_mem_h memh,
                           std::span<const std::uint8_t> prefix) {
  if (conn.ep == nullptr || conn.ep_released || conn.ep_closing) return UCS_ERR_CANCELED;
  const auto fixed = encode_header(
      AmHeader{type, conn.tx_seq, static_cast<std::uint8_t>(prefix.size()), conn.peer_token});
  std::copy(fixed.begin(), fixed.end(), op.am_header.begin());
  if (!prefix.empty())
    std::copy(prefix.begin(), prefix.end(), op.am_header.begin() + AM_HEADER_SIZE);
  op.am_header_len = AM_HEADER_SIZE + prefix.size();
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.cb.send = &Backend::send_callback;
  param.user_data = &op;
  param.datatype = datatype;
  if (memh != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = memh;
  }
  // The UCX header stays in the op until completion (UCX 1.13 has no
  // UCP_AM_SEND_FLAG_COPY_HEADER; with it the header could live on the stack).
  void* const request = ucp_am_send_nbx(conn.ep->handle, AM_ID, op.am_header.data(),
                                        op.am_header_len, buffer, count, &param);
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  ++conn.tx_seq;
  if (request == nullptr) return UCS_OK;
  ++conn.requests;
  return UCS_INPROGRESS;
}

void Backend::push_event(Event event) {
  const std::lock_guard lock{m_events_mutex};
  m_events.push_back(std::move(event));
}

void Backend::send_callback(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  Backend* self = op->conn->backend;
  ucp_request_free(request);
  self->push_event(Event{
      .kind = Event::Kind::SEND_DONE, .id = op->conn->id, .slot = op->slot, .status = status});
}

void Backend::ep_error_callback(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* endpoint = static_cast<Endpoint*>(arg);
  endpoint->backend->push_event(
      Event{.kind = Event::Kind::EP_ERROR, .id = endpoint->id, .status = status});
}

void Backend::ep_close_callback(void* request, ucs_status_t status, void* user_data) {
  auto* endpoint = static_cast<Endpoint*>(user_data);
  ucp_request_free(request);
  endpoint->backend->push_event(
      Event{.kind = Event::Kind::EP_CLOSED, .id = endpoint->id, .status = status});
}

void Backend::receive_callback(void* request, ucs_status_t status, std::size_t length,
                               void* user_data) {
  auto* slot = static_cast<Incoming*>(user_data);
  ucp_request_free(request);
  slot->conn->backend->finish_receive(*slot, status, length);
}

ucs_status_t Backend::am_callback(void* arg, const void* header, std::size_t header_length,
                                  void* data, std::size_t length,
                                  const ucp_am_recv_param_t* param) {
  return static_cast<Backend*>(arg)->on_message(
      {static_cast<const std::uint8_t*>(header), header_length}, data, length, *param);
}

ucs_status_t Backend::stranger_am_callback(void* arg, const void* /*header*/,
                                           std::size_t header_length, void* /*data*/,
                                           std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Backend*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (!self->shut_down()) {
    NETIO3_LOG_LIMITED(self->m_stranger_log, LogLevel::warn,
                       "ucx: dropping a message of {} bytes on an active message id netio3 does "
                       "not use (a worker that is not netio3's reached this one)",
                       header_length + length);
  }
  return rndv ? UCS_ERR_CANCELED : UCS_OK;  // as on_message drops
}

ucs_status_t Backend::on_message(std::span<const std::uint8_t> header, void* data,
                                 std::size_t length, const ucp_am_recv_param_t& param) {
  const bool rndv = (param.recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  const bool persistent = (param.recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
  // Dropping a rendezvous message fails the sender's send; an eager one is just freed.
  const ucs_status_t drop = rndv ? UCS_ERR_CANCELED : UCS_OK;
  if (shut_down()) return drop;
  std::string error;
  const auto decoded = decode_header(header, error);
  if (!decoded) {
    // Not addressed to a connection that can be named: nothing to close.
    NETIO3_LOG_LIMITED(m_stranger_log, LogLevel::warn, "ucx: dropping a message: {}", error);
    return drop;
  }
  const auto conn = m_registry.by_id(decoded->token);
  if (!conn) {
    NETIO3_DEBUG("ucx: dropping a message for a connection that is gone");
    return drop;
  }
  if (conn->failed || conn->ending()) return drop;
  const std::uint64_t seq = decoded->seq;
  if (seq < conn->rx_next || seq - conn->rx_next >= MAX_REORDER) {
    protocol_error(*conn, fmt::format("message number {} outside the window [{}, {})", seq,
                                      conn->rx_next, conn->rx_next + MAX_REORDER));
    return drop;
  }
  const auto index = static_cast<std::size_t>(seq - conn->rx_next);
  if (index >= conn->inbox.size()) conn->inbox.resize(index + 1);
  Incoming& slot = conn->inbox[index];
  if (slot.stage != Incoming::Stage::EMPTY) {
    protocol_error(*conn, fmt::format("message number {} arrived twice", seq));
    return drop;
  }
  const std::span<const std::uint8_t> prefix = header.subspan(AM_HEADER_SIZE);
  if (decoded->type == MessageType::ACK) {
    // Its count is in the prefix; nothing to hold.
    if (length != 0) {
      protocol_error(*conn, fmt::format("an ACK message with {} bytes of payload", length));
      return drop;
    }
    slot.type = MessageType::ACK;
    slot.count = detail::load_le64(prefix.data());
    slot.stage = Incoming::Stage::READY;
    slot.length = 0;
    mark_dirty(*conn);
    return UCS_OK;
  }
  const std::size_t limit =
      decoded->type == MessageType::DATA ? m_config.limits.max_message_size : 0;
  if (length > limit || prefix.size() > limit - length) {
    protocol_error(*conn, fmt::format("a message of {} bytes exceeds the limit of {} bytes",
                                      prefix.size() + length, limit));
    return rndv ? UCS_ERR_MESSAGE_TRUNCATED : UCS_OK;
  }
  slot.type = decoded->type;
  mark_dirty(*conn);
  if (rndv) {
    // The payload is fetched later (start_receive) behind a copy of the prefix.
    slot.stage = Incoming::Stage::RNDV;
    slot.length = length;
    std::copy(prefix.begin(), prefix.end(), slot.prefix.begin());
    slot.prefix_len = static_cast<std::uint8_t>(prefix.size());
    slot.desc = data;
    return UCS_INPROGRESS;
  }
  // What waits in the inbox holds memory (a copy, or UCX's descriptor) until its turn: a peer
  // that skips a sequence number and floods would pin it without bound.
  const std::size_t held = prefix.size() + length;
  if (held > m_config.limits.max_receive_memory -
                 std::min(m_inbox_bytes, m_config.limits.max_receive_memory)) {
    protocol_error(*conn, fmt::format("messages waiting for an earlier one hold {} bytes; {} more "
                                      "would exceed limits.max_receive_memory ({} bytes)",
                                      m_inbox_bytes, held, m_config.limits.max_receive_memory));
    return drop;
  }
  m_inbox_bytes += held;
  slot.held = held;
  slot.stage = Incoming::Stage::READY;
  slot.length = prefix.size() + length;
  if (persistent && prefix.empty()) {
    slot.desc = data;
    slot.data = static_cast<const std::uint8_t*>(data);
    return UCS_INPROGRESS;
  }
  if (slot.length > 0) {
    // Eager data UCX takes back on return, or prefix and payload joined: one copy, into
    // a receive-pool buffer when one is free (no allocation per message), else the heap.
    std::uint8_t* target = nullptr;
    if (conn->recv && slot.length <= conn->recv->pool.buf_size()) {
      slot.buffer = conn->recv->pool.acquire();
      if (slot.buffer != nullptr) target = slot.buffer->data();
    }
    if (target == nullptr) {
      slot.heap = std::make_unique_for_overwrite<std::uint8_t[]>(slot.length);
      target = slot.heap.get();
    }
    if (!prefix.empty()) std::memcpy(target, prefix.data(), prefix.size());
    if (length > 0) std::memcpy(target + prefix.size(), data, length);
    slot.data = target;
  }
  return UCS_OK;
}

void Backend::protocol_error(Connection& conn, const std::string& why) {
  conn.failed = true;
  NETIO3_WARN("ucx: connection with {}: {}", conn.remote, why);
  push_event(Event{.kind = Event::Kind::PROTOCOL_ERROR, .id = conn.id, .reason = why});
}

void Backend::mark_dirty(Connection& conn) {
  if (conn.dirty) return;
  conn.dirty = true;
  m_dirty.push_back(std::static_pointer_cast<Connection>(conn.shared_from_this()));
}

void Backend::finish_receive(Incoming& slot, ucs_status_t status, std::size_t length) {
  Connection& conn = *slot.conn;
  --conn.receiving;
  conn.receiving_bytes -= std::min(conn.receiving_bytes, slot.length);
  if (slot.stage == Incoming::Stage::DROPPED) {
    release(conn, slot);  // its connection closed meanwhile
  } else if (status == UCS_OK) {
    slot.stage = Incoming::Stage::READY;
    slot.length = slot.prefix_len + std::min(length, slot.length);
    slot.prefix_len = 0;
  } else {
    slot.stage = Incoming::Stage::FAILED;
    slot.status = status;
  }
  mark_dirty(conn);
}

bool Backend::progress() {
  if (m_progressing || shut_down() || !m_worker) return false;
  m_progressing = true;
  bool active = false;
  const auto deadline = std::chrono::steady_clock::now() + m_progress_budget;
  // UCX may be armed only after a progress call that did nothing: one that did something
  // may have left work that no descriptor will announce (with no endpoint yet, UCX's tcp
  // transport read the connections its listener had accepted only in a further call).
  m_progress_unfinished = true;
  for (int round = 0; round < PROGRESS_ROUNDS; ++round) {
    const unsigned n = ucp_worker_progress(m_worker->get());
    const bool work = has_work();
    active = active || n != 0 || work;
    dispatch(deadline);
    if (shut_down()) return active;  // the backend is going: leave the flag set
    if (n == 0 && !has_work()) {
      m_progress_unfinished = false;
      break;
    }
    // Past the budget: back on the loop's next round, without sleeping (may_sleep).
    if (std::chrono::steady_clock::now() >= deadline) break;
  }
  m_progressing = false;
  return active;
}

bool Backend::has_work() {
  {
    const std::lock_guard lock{m_events_mutex};
    if (!m_events.empty()) return true;
  }
  return !m_dirty.empty();
}

bool Backend::may_sleep() {
  if (shut_down()) return true;
  const bool active = progress();
  if (shut_down()) return true;
  if (has_work() || m_progress_unfinished) return false;
  // Busy-polling (EpollEventLoop::Options::busy_poll): the loop will not sleep this
  // round, so arming would be wasted; say whether there was work to keep it polling.
  if (m_loop->polling()) return !active;
  const ucs_status_t status = ucp_worker_arm(m_worker->get());
  if (status == UCS_ERR_BUSY) return false;
  if (status != UCS_OK) {
    NETIO3_ERROR("ucx: ucp_worker_arm failed: {}", status_text(status));
    return false;
  }
  return true;
}

void Backend::dispatch(std::chrono::steady_clock::time_point deadline) {
  for (int guard = 0; guard < 1024 && !shut_down(); ++guard) {
    if (guard > 0 && std::chrono::steady_clock::now() >= deadline) return;
    // The spare vectors keep their capacity from round to round: recording an event
    // does not allocate once the queues have grown (a nested dispatch, from a callback
    // that progresses, finds them taken and starts empty ones).
    std::vector<Event> events = std::move(m_spare_events);
    {
      const std::lock_guard lock{m_events_mutex};
      events.swap(m_events);
    }
    std::vector<std::shared_ptr<Connection>> dirty = std::move(m_spare_dirty);
    dirty.swap(m_dirty);
    if (events.empty() && dirty.empty()) {
      m_spare_events = std::move(events);
      m_spare_dirty = std::move(dirty);
      return;
    }
    for (auto& event : events) {
      handle(event);
      if (shut_down()) return;
    }
    for (const auto& conn : dirty) {
      service_inbox(conn);
      if (shut_down()) return;
    }
    events.clear();
    dirty.clear();
    m_spare_events = std::move(events);
    m_spare_dirty = std::move(dirty);
  }
}

void Backend::handle(Event& event) {
  switch (event.kind) {
    case Event::Kind::SENT_AT_ONCE: {
      const auto& conn = event.conn;
      {
        const std::lock_guard lock{conn->mutex};
        --conn->completions_queued;
      }
      if (!completed(*conn, detail::PendingSend{event.key, event.buffer})) return;
      if (conn->phase == Phase::CLOSING) advance_close(conn);
      return;
    }
    case Event::Kind::EP_ERROR:
      on_endpoint_error(event.id, event.status);
      return;
    case Event::Kind::EP_CLOSED:
      on_endpoint_closed(event.id, event.status);
      return;
    default:
      break;
  }
  const auto conn = m_registry.by_id(event.id);
  if (!conn) return;
  if (event.kind == Event::Kind::SEND_DONE) {
    on_send_done(conn, event.slot, event.status);
  } else {
    close(conn, event.reason, CloseCause::PROTOCOL);  // protocol_error()
  }
}

void Backend::on_send_done(const std::shared_ptr<Connection>& conn, std::uint32_t slot,
                           ucs_status_t status) {
  detail::PendingSend done;
  bool done_now = false;
  {
    const std::lock_guard lock{conn->mutex};
    SendOp& op = conn->ops[slot];
    --conn->requests;
    if (status == UCS_OK && conn->ep) conn->ep->last_progress = std::chrono::steady_clock::now();
    if (!op.control) {
      --conn->data_ops;
      conn->unsent_bytes -= std::min<std::uint64_t>(conn->unsent_bytes, op.bytes);
      if (status == UCS_OK) done_now = conn->ledger.complete(op.ticket, done);
    }
    release_op(*conn, op);
  }
  if (status != UCS_OK) {
    // The key is reported with the connection's cancelled keys.
    if (!conn->ending()) {
      NETIO3_WARN("ucx: connection with {}: send failed: {}", conn->remote, status_text(status));
      close(conn, fmt::format("send failed: {}", status_text(status)), CloseCause::ERROR);
    }
  } else if (done_now && !completed(*conn, done)) {
    return;
  }
  // CLOSED: a request that outlived the report of the close (on_endpoint_closed); the
  // connection may be freed now.
  if (conn->ending()) advance_close(conn);
}

void Backend::on_ep_error(const std::shared_ptr<Connection>& conn, const std::string& why) {
  if (conn->ending()) return;
  // What arrived complete before the error is still delivered (a BYE among it makes this
  // an orderly close); service_inbox closes once nothing more can come.
  conn->peer_error = why;
  NETIO3_DEBUG("ucx: connection with {}: {}", conn->remote, conn->peer_error);
  mark_dirty(*conn);
}

void Backend::service_inbox(const std::shared_ptr<Connection>& conn) {
  conn->dirty = false;
  if (conn->ending()) {
    advance_close(conn);
    return;
  }
  if (conn->phase == Phase::HANDSHAKE) {
    // Set-up: message 0 must be the peer's READY; what follows it waits until the HELLO is
    // in too (nothing is received for a connection that is not set up).
    if (!conn->peer_ready && !conn->inbox.empty() &&
        conn->inbox.front().stage == Incoming::Stage::READY) {
      Incoming message = std::move(conn->inbox.front());
      conn->inbox.pop_front();
      ++conn->rx_next;
      release(*conn, message);
      if (message.type != MessageType::READY) {
        protocol_error_now(conn, "the peer's first message is not READY");
        return;
      }
      conn->peer_ready = true;
      const std::lock_guard lock{conn->mutex};
      if (conn->ep) conn->ep->proven = true;
    }
    if (!conn->peer_error.empty()) {
      close(conn, conn->peer_error, CloseCause::ERROR);
      return;
    }
    if (!conn->peer_ready || !conn->greeted) return;
    // Both HELLO and the peer's READY are in.
    if (!established(conn, capabilities(*conn))) return;
  }
  if (conn->phase != Phase::OPEN) return;
  while (!conn->inbox.empty()) {
    Incoming& front = conn->inbox.front();
    if (front.stage != Incoming::Stage::READY && front.stage != Incoming::Stage::FAILED) break;
    Incoming message = std::move(front);
    conn->inbox.pop_front();
    ++conn->rx_next;
    m_delivering = &message;  // a callback that destroys the backend leaves it to shutdown
    handle_message(conn, message);
    m_delivering = nullptr;
    release(*conn, message);
    if (shut_down()) return;
    if (conn->ending()) {
      advance_close(conn);
      return;
    }
  }
  // Then the rendezvous messages are fetched: after the deliveries, so that the buffers they
  // released (the most recent first, still in cache) take the next payloads. Not once the
  // peer's endpoint failed: the connection closes below (discarding them), and by CMA a fetch
  // would read memory the sender may have reused since its sends ended.
  const std::size_t window = conn->by_cma ? 0 : RECEIVE_WINDOW;
  for (auto& slot : conn->inbox) {
    if (!conn->peer_error.empty()) break;
    if (slot.stage != Incoming::Stage::RNDV) continue;
    if (conn->receiving > 0 && conn->receiving_bytes + slot.length > window) break;
    start_receive(*conn, slot);
    // One that completed at once is delivered first, on the next pass (mark_dirty).
    if (conn->by_cma) break;
  }
  if (conn->peer_total && conn->rx_next >= *conn->peer_total) {
    close(conn, "peer closed the connection", CloseCause::PEER);
  } else if (!conn->peer_error.empty()) {
    // The peer is gone: what is still on its way (a rendezvous in flight) cannot complete.
    NETIO3_INFO("ucx: connection with {}: {}", conn->remote, conn->peer_error);
    close(conn, conn->peer_error, CloseCause::ERROR);
  }
}

void Backend::start_receive(Connection& conn, Incoming& slot) {
  NetworkBuffer* buffer = nullptr;
  const std::size_t total = slot.prefix_len + slot.length;
  // The payload is fetched to a 64-byte boundary where the buffer has room for it, the
  // prefix just before it.
  std::size_t lead = (PAYLOAD_ALIGNMENT - slot.prefix_len % PAYLOAD_ALIGNMENT) % PAYLOAD_ALIGNMENT;
  if (conn.recv && total <= conn.recv->pool.buf_size()) {
    buffer = conn.recv->pool.acquire();
    if (total + lead > conn.recv->pool.buf_size()) lead = 0;
  }
  std::uint8_t* start = nullptr;
  ucp_mem_h memh = nullptr;
  if (buffer != nullptr) {
    slot.buffer = buffer;
    start = buffer->data() + lead;
    memh = conn.recv->map.get();
  } else {
    slot.heap = std::make_unique_for_overwrite<std::uint8_t[]>(std::max<std::size_t>(total, 1));
    start = slot.heap.get();
  }
  if (slot.prefix_len > 0) std::memcpy(start, slot.prefix.data(), slot.prefix_len);
  slot.stage = Incoming::Stage::RECEIVING;
  slot.data = start;
  fetch(conn, slot, start + slot.prefix_len, memh);
}

void Backend::fetch(Connection& conn, Incoming& slot, void* target, ucp_mem_h memh) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_RECV_INFO;
  if (memh != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = memh;
  }
  std::size_t received = 0;
  param.cb.recv_am = &Backend::receive_callback;
  param.user_data = &slot;
  param.datatype = ucp_dt_make_contig(1);
  param.recv_info.length = &received;
  slot.conn = &conn;
  void* desc = std::exchange(slot.desc, nullptr);
  ++conn.receiving;
  conn.receiving_bytes += slot.length;
  void* const request = ucp_am_recv_data_nbx(m_worker->get(), desc, target, slot.length, &param);
  if (request == nullptr) {
    finish_receive(slot, UCS_OK, received);
  } else if (UCS_PTR_IS_ERR(request)) {
    finish_receive(slot, UCS_PTR_STATUS(request), 0);
  }
}

void Backend::handle_message(const std::shared_ptr<Connection>& conn, const Incoming& message) {
  if (message.stage == Incoming::Stage::FAILED) {
    const auto reason = fmt::format("receiving a message of {} bytes failed: {}", message.length,
                                    status_text(message.status));
    NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
    close(conn, reason, CloseCause::ERROR);
    return;
  }
  if (message.type == MessageType::BYE) {
    close(conn, "peer closed the connection", CloseCause::PEER);
    return;
  }
  if (message.type == MessageType::READY) {
    protocol_error_now(conn, "a second READY");
    return;
  }
  if (message.type == MessageType::ACK) {
    (void)acknowledgement(conn, message.count);
    return;
  }
  (void)deliver(*conn, std::span<const std::uint8_t>{message.data, message.length});
}

bool Backend::discard_area() noexcept {
  if (m_discard) return true;
  try {
    m_discard = std::make_unique_for_overwrite<std::uint8_t[]>(m_config.limits.max_message_size);
  } catch (const std::bad_alloc&) {
    NETIO3_WARN("ucx: no memory ({} bytes) to drop rendezvous messages through",
                m_config.limits.max_message_size);
    return false;
  }
  return true;
}

void Backend::discard(Connection& conn, Incoming& slot) {
  if (slot.stage == Incoming::Stage::RNDV && slot.desc != nullptr && m_worker && safe() &&
      discard_area()) {
    // A rendezvous message never fetched is fetched now and thrown away, not given back with
    // ucp_am_data_release: UCX 1.13 sends the sender's acknowledgement from there out of the
    // worker's request pool without the worker's lock, which races a thread sending on the
    // same worker (SAFE mode; seen under ASan: ucp_request.inl:216 assertion and a heap
    // overflow in a rendezvous header). ucp_am_recv_data_nbx takes the lock. With only the
    // loop thread in UCX (UNSAFE) there is no race and no fetch. All such fetches share one
    // scratch area of max_message_size (allocated at the first, touched only as far as the
    // largest message; on_message bounds every length by that limit).
    slot.stage = Incoming::Stage::DROPPED;  // finish_receive releases it
    slot.data = nullptr;
    fetch(conn, slot, m_discard.get(), nullptr);
    return;
  }
  if (slot.stage != Incoming::Stage::RECEIVING) release(conn, slot);
  slot.stage = Incoming::Stage::DROPPED;
}

void Backend::release(Connection& conn, Incoming& message) {
  m_inbox_bytes -= std::min(m_inbox_bytes, std::exchange(message.held, 0));
  // After a shutdown (a callback destroyed the backend) the worker and its data are gone.
  if (message.desc != nullptr && m_worker) ucp_am_data_release(m_worker->get(), message.desc);
  message.desc = nullptr;
  if (message.buffer != nullptr && conn.recv) conn.recv->pool.release(message.buffer);
  message.buffer = nullptr;
  message.heap.reset();
  message.data = nullptr;
}

void Backend::skip_sequence_numbers(const EndPointAddress& remote, std::uint64_t n) {
  const auto conn = m_registry.get(remote, "skip_sequence_numbers");
  const std::lock_guard lock{conn->mutex};
  conn->tx_seq += n;
}

}  // namespace netio3::ucx
