// asyncmsg, the set-up of a connection: accepting and connecting, the greetings, admission
// (docs/admission.md: the partition key's challenge and proofs, the accept hook), refusals.
//
// Threads and locks: as in asyncmsg_backend.cpp (all of this runs on the loop thread).

#include "backends/asyncmsg/asyncmsg_backend_impl.hpp"

namespace netio3::asyncmsg {

void Backend::on_acceptable(const std::shared_ptr<Listener>& listener, std::uint32_t /*events*/) {
  assert_loop_thread();
  for (int i = 0; i < ACCEPTS_PER_EVENT && !shut_down(); ++i) {
    tcp::socket socket{*m_io};
    tcp::endpoint peer;
    boost::system::error_code ec;
    {
      const std::lock_guard lock{listener->mutex};
      if (listener->closed) return;
      listener->acceptor.accept(socket, peer, ec);
    }
    if (ec == asio::error::would_block || ec == asio::error::try_again) return;
    if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space ||
        ec == asio::error::no_memory || ec.value() == ENFILE) {
      detail::pause_accepting(*listener, fmt::format("accept failed: {}", ec.message()));
      return;
    }
    if (ec) {
      NETIO3_DEBUG("asyncmsg: accept on {} failed: {}", listener->address, ec.message());
      continue;
    }
    if (detail::descriptor_table_nearly_full(socket.native_handle())) {
      // Keep descriptors for the rest of the process (timers, other backends' transports).
      detail::pause_accepting(*listener,
                              detail::descriptor_table_nearly_full_text(socket.native_handle()) +
                                  "; the connection is refused");
      return;
    }
    listener->pauses->accepted();
    accept_one(listener, std::move(socket), peer);
  }
}

void Backend::accept_one(const std::shared_ptr<Listener>& listener, tcp::socket socket,
                         const tcp::endpoint& peer) {
  boost::system::error_code ec;
  socket.non_blocking(true, ec);
  std::string error =
      ec ? ec.message()
         : detail::configure_stream(socket.native_handle(), m_config.limits.peer_timeout);
  if (!error.empty()) {
    NETIO3_WARN("asyncmsg: cannot configure socket accepted on {}: {}", listener->address, error);
    return;
  }
  EndPointAddress remote{peer.address().to_string(), peer.port()};
  auto conn = std::make_shared<Connection>(next_id(), m_io, m_chunks, m_bodies, remote,
                                           listener->params, listener->id, Phase::HANDSHAKE);
  conn->socket = std::move(socket);
  Admission admission{};
  {
    const auto held = m_registry.lock();
    admission = Engine::admission(held, *listener, remote);
    if (admission == Admission::ACCEPT) {
      {
        const std::lock_guard conn_lock{conn->mutex};
        conn->fd = m_loop->add_fd(conn->socket.native_handle(), EPOLLIN, socket_callback(conn));
      }
      m_registry.add_connection(held, conn);
      track_setup(conn);
    }
  }
  if (admission == Admission::LISTENER_CLOSED) return;
  if (admission == Admission::SOURCE_PORT_COLLISION) {
    refuse_address_in_use(*conn);
    return;
  }
  NETIO3_DEBUG("asyncmsg: accepted connection from {} on {}", remote, listener->address);
  conn->listener_address = listener->address;
  send_greeting(conn);
}

void Backend::on_connect_done(const std::shared_ptr<Connection>& conn) {
  if (const auto failure = detail::connect_failure(conn->socket.native_handle())) {
    refuse(conn, RefusalCause::UNREACHABLE, *failure);
    return;
  }
  {
    const std::lock_guard lock{conn->mutex};
    conn->phase = Phase::HANDSHAKE;
    conn->fd.modify(EPOLLIN);
  }
  conn->epollout = false;
  NETIO3_DEBUG("asyncmsg: TCP connection to {} up, greeting", conn->remote);
  send_greeting(conn);
}

int Backend::start_connect(tcp::socket& socket, const EndPointAddress& remote) const {
  const auto protocol = asio::ip::make_address(remote.address).is_v4() ? tcp::v4() : tcp::v6();
  auto started = detail::connect_tcp(remote, m_config.limits.peer_timeout);
  boost::system::error_code ec;
  if (socket.assign(protocol, started.socket.get(), ec); ec) {
    throw std::runtime_error("adopting the socket failed: " + ec.message());
  }
  started.socket.release();
  return started.error;
}

std::string Backend::connect_again(tcp::socket& socket, const EndPointAddress& remote) const {
  try {
    if (const int err = start_connect(socket, remote); err != 0) {
      return "connect failed: " + detail::errno_text(err);
    }
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return {};
}

void Backend::reset_stream_state(Connection& conn) noexcept {
  conn.epollout = false;
  conn.large_messages = false;
  conn.wake_threshold = 1;  // a new socket
  conn.queued_at_tick = 0;
}

bool Backend::reconnect_from_new_source_port(const std::shared_ptr<Connection>& conn) {
  if (!detail::retry_from_new_source_port(*conn, NAME)) return false;
  tcp::socket fresh{*m_io};
  if (const std::string why = connect_again(fresh, conn->remote); !why.empty()) {
    NETIO3_WARN("asyncmsg: connecting again to {}: {}", conn->remote, why);
    return false;
  }
  {
    const std::lock_guard lock{conn->mutex};
    conn->fd.close();
    conn->queue.clear();
    conn->flush_pending = false;
    conn->phase = Phase::CONNECTING;
  }
  drain_and_close(conn->socket);
  conn->socket = std::move(fresh);
  conn->decoder.reset();
  conn->decoder.set_max_message_size(detail::MAX_ADMISSION_FRAME);
  reset_stream_state(*conn);
  const std::lock_guard lock{conn->mutex};
  conn->fd = m_loop->add_fd(conn->socket.native_handle(), EPOLLOUT, socket_callback(conn));
  return true;
}

void Backend::refuse_address_in_use(Connection& conn) {
  const auto refusal = detail::encode_refusal_greeting(detail::ASYNCMSG_PROTOCOL);
  if (detail::send_now(conn.socket.native_handle(), refusal)) {
    linger(conn);
  } else {
    drain_and_close(conn.socket);
  }
}

void Backend::send_greeting(const std::shared_ptr<Connection>& conn) {
  write_setup(conn,
              admission_opening(
                  *conn, Greeting{.minor = VERSION_MINOR,
                                  .max_message_size = static_cast<std::uint32_t>(m_max_message)}));
}

void Backend::write_setup(const std::shared_ptr<Connection>& conn,
                          std::span<const std::uint8_t> frames) {
  {
    const std::lock_guard lock{conn->mutex};
    conn->queue.append_copy(frames);
    conn->flush_pending = true;
  }
  flush(conn, std::chrono::steady_clock::now() + FLUSH_BUDGET);
}

bool Backend::setup_alive(const Connection& conn) const noexcept {
  return !shut_down() && !conn.ending();
}

void Backend::refuse_and_linger(Connection& conn, std::span<const std::uint8_t> refusal) {
  {
    const std::lock_guard lock{conn.mutex};
    if (conn.queue.empty() && !refusal.empty()) {
      (void)detail::send_now(conn.socket.native_handle(), refusal);
    }
  }
  // Also after a partial write: a close with unread input or unsent bytes would reset.
  conn.linger_on_close = true;
}

bool Backend::on_greeting(const std::shared_ptr<Connection>& conn, const Greeting& greeting) {
  // Closed by the application during set-up: its close reports it (closed, no keys) and
  // the connection is never reported established.
  if (conn->close_requested.load(std::memory_order_relaxed)) return false;
  {
    const std::lock_guard lock{conn->mutex};
    conn->max_send_message = std::min<std::size_t>(m_max_message, greeting.max_message_size);
  }
  NETIO3_DEBUG("asyncmsg: {} speaks protocol {}.{}, accepts messages up to {} bytes, flags {:#x}",
               conn->remote, greeting.major, greeting.minor, greeting.max_message_size,
               greeting.flags);
  // 1.2 and later send heartbeats and accept them; older peers neither (their silence is
  // then noticed only through TCP: keepalive and TCP_USER_TIMEOUT, see configure_stream).
  conn->peer_sends_heartbeats = greeting.minor >= detail::ASYNCMSG_HEARTBEAT_MINOR;
  conn->peer_takes_heartbeats = conn->peer_sends_heartbeats;
  conn->peer_says_goodbye = greeting.minor >= detail::ASYNCMSG_GOODBYE_MINOR;
  const bool peer_sessions = greeting.minor >= detail::ASYNCMSG_SESSION_MINOR;
  conn->wants_session =
      !conn->active() && peer_sessions && (greeting.flags & detail::GREETING_SESSION) != 0;
  if (conn->session.enabled && !peer_sessions) {
    return setup_protocol_error(
        conn, "the peer cannot resume sessions (its netio3 is too old for delivery.session)");
  }
  return admission_greeting(conn, greeting);
}

bool Backend::admitted(const std::shared_ptr<Connection>& conn) {
  try {
    if (!conn->active()) attach_send_pool(*conn);
  } catch (const std::exception& e) {
    // Allocated only once the peer has been admitted (a silent or refused connection costs
    // no buffers); the peer may already count the connection as established.
    const auto reason = fmt::format("cannot allocate send buffers: {}", e.what());
    NETIO3_WARN("asyncmsg: closing connection with {}: {}", conn->remote, reason);
    close(conn, reason, CloseCause::ERROR);
    return false;
  }
  conn->decoder.set_max_message_size(m_max_message);
  if (conn->session.enabled) {
    // A client with a session: a new one, or (a carrier) the resume of its connection's.
    // Or a farewell: the application closed the session while it was interrupted.
    const auto target = std::static_pointer_cast<Connection>(conn->session.resumes.lock());
    const std::uint8_t flags = conn->session.farewell ? detail::SESSION_END
                               : target               ? detail::SESSION_RESUME
                                                      : std::uint8_t{0};
    const std::uint64_t count = conn->session.farewell ? conn->session.farewell_count
                                : target               ? target->acks.delivered
                                                       : 0;
    const auto frame = session_frame(
        conn->session.id, count, static_cast<std::uint64_t>(conn->session.give_up.count()), flags);
    conn->awaiting_session = true;
    write_setup(conn, frame);
    return setup_alive(*conn);
  }
  if (conn->wants_session) {
    conn->awaiting_session = true;  // the client's SESSION frame comes next
    return setup_alive(*conn);
  }
  return established(conn, capabilities(*conn));
}

// ---- sessions (DeliveryParameters::Session; docs/sessions.md) ----------------------------

std::array<std::uint8_t, FRAME_HEADER_SIZE + detail::SESSION_BODY_SIZE> session_frame(
    const detail::ConnectionBase::SessionId& id, std::uint64_t count, std::uint64_t give_up_ms,
    std::uint8_t flags) {
  std::array<std::uint8_t, FRAME_HEADER_SIZE + detail::SESSION_BODY_SIZE> frame{};
  encode_frame_header(frame.data(), detail::SESSION_BODY_SIZE, detail::FRAME_SESSION);
  detail::encode_session_body({.id = id, .count = count, .give_up_ms = give_up_ms, .flags = flags},
                              false, frame.data() + FRAME_HEADER_SIZE);
  return frame;
}

bool Backend::on_session(const std::shared_ptr<Connection>& conn,
                         std::span<const std::uint8_t> body) {
  if (shut_down() || conn->ending() || conn->close_requested.load()) return false;
  const auto violation = [&](std::string_view what) {
    return conn->setting_up() ? setup_protocol_error(conn, what) : protocol_violation(conn, what);
  };
  const auto frame = detail::decode_session_body(body, false);
  if (!frame) return violation(fmt::format("a SESSION frame with {} bytes of body", body.size()));
  const auto& id = frame->id;
  const std::uint64_t count = frame->count;
  const std::uint8_t flags = frame->flags;
  if (conn->awaiting_go) {
    // Server, resuming: the client has the new connection; what it had not delivered follows.
    if (flags != detail::SESSION_GO || id != conn->session.id) {
      return violation("a SESSION frame other than the GO of the resumed session");
    }
    conn->awaiting_go = false;
    carry_on(conn, {}, conn->resume_from);
    return resumed(conn, conn->resume_from);
  }
  if (!conn->awaiting_session) return violation("an unexpected SESSION frame");
  conn->awaiting_session = false;
  return conn->active() ? session_answer(conn, id, count, flags)
                        : session_request(conn, id, count, frame->give_up_ms, flags);
}

bool Backend::session_request(const std::shared_ptr<Connection>& conn,
                              const detail::ConnectionBase::SessionId& id, std::uint64_t count,
                              std::uint64_t give_up_ms, std::uint8_t flags) {
  const std::string key{id.begin(), id.end()};
  // The client's give_up, at most ten minutes: a peer cannot pin an interrupted session (and
  // its replay window) for longer.
  constexpr std::uint64_t MAX_GIVE_UP_MS = 10ULL * 60 * 1000;
  give_up_ms = std::min(give_up_ms, MAX_GIVE_UP_MS);
  const auto it = m_sessions.find(key);
  auto session = it != m_sessions.end() ? it->second.lock() : nullptr;
  const bool known = session && !session->ending() && !session->close_requested.load() &&
                     session->remote.address == conn->remote.address;
  if (flags == detail::SESSION_END) {
    // The client's application closed the session while it was interrupted: it ends here
    // too, now rather than at give_up (what it had not delivered is the client's to list).
    refuse_and_linger(*conn, session_frame(id, known ? session->acks.delivered : 0, 0,
                                           known ? detail::SESSION_END : detail::SESSION_UNKNOWN));
    refuse(conn, RefusalCause::SETUP_FAILED, "the connection only ended a session");
    if (!known || shut_down()) return false;
    NETIO3_INFO("asyncmsg: {} closed the session of its connection with {}", conn->remote.address,
                session->remote);
    // What the client's application was handed completes (its END carries the count, as
    // the acknowledgement before a goodbye would); a count that breaks the protocol closes
    // the session as such.
    if (!acknowledgement(session, count) || session->ending()) return false;
    close(session, "the peer closed the session while it was interrupted", CloseCause::PEER);
    return false;
  }
  if ((flags & detail::SESSION_RESUME) == 0) {
    if (flags != 0 || give_up_ms == 0 || m_sessions.contains(key)) {
      return setup_protocol_error(conn, "a SESSION frame that opens no valid new session");
    }
    conn->session.id = id;
    conn->session.give_up = std::chrono::milliseconds{give_up_ms};
    {
      const std::lock_guard lock{conn->mutex};  // a send may look at them from another thread
      conn->session.enabled = true;
      conn->ledger.expect_acknowledgements();
      conn->ledger.expect_transport_first();
    }
    conn->acknowledged_sends.store(true);
    conn->acks.peer_wants_acks = true;
    m_sessions[key] = conn;
    write_setup(conn, session_frame(id, 0, give_up_ms, 0));
    if (!setup_alive(*conn)) return false;
    return established(conn, capabilities(*conn));
  }
  if (flags != detail::SESSION_RESUME) {
    return setup_protocol_error(conn, "a SESSION frame that asks neither a resume nor an end");
  }
  if (!known) {
    NETIO3_WARN("asyncmsg: {} asked to resume a session this process does not know; refused",
                conn->remote);
    refuse_and_linger(*conn, session_frame(id, 0, 0, detail::SESSION_UNKNOWN));
    refuse(conn, RefusalCause::SETUP_FAILED, "unknown session");
    return false;
  }
  if (!session->session.down) {
    interrupt(session,
              "the peer resumed the session on a new connection (the old one broke "
              "without this side noticing)",
              CloseCause::SILENT);
    if (shut_down()) return false;
    if (session->ending()) {  // closed in the interrupted callback
      refuse(conn, RefusalCause::SETUP_FAILED, "the session ended");
      return false;
    }
  }
  adopt(session, conn);
  session->awaiting_go = true;
  session->resume_from = count;
  {
    const std::lock_guard lock{session->mutex};
    session->queue.append_copy(
        session_frame(id, session->acks.delivered, 0, detail::SESSION_RESUME));
    session->flush_pending = true;
  }
  // Written from the loop's next round: a write that fails then interrupts the session again
  // (this call is inside the carrier's read).
  request_flush(session);
  close(conn, "its connection carries a resumed session", CloseCause::LOCAL, false);
  return false;  // the session's connection reads what follows
}

bool Backend::session_answer(const std::shared_ptr<Connection>& conn,
                             const detail::ConnectionBase::SessionId& id, std::uint64_t count,
                             std::uint8_t flags) {
  if (id != conn->session.id) {
    return setup_protocol_error(conn, "a SESSION frame for another session");
  }
  if (conn->session.farewell) {
    // The peer ended the session (END), or no longer knew it (UNKNOWN): either way done.
    NETIO3_DEBUG("asyncmsg: {} was told that the session ended ({})", conn->remote,
                 flags == detail::SESSION_END ? "it ended it" : "it did not know it any more");
    close(conn, "the peer was told that the session ended", CloseCause::LOCAL, false);
    return false;
  }
  const auto target = std::static_pointer_cast<Connection>(conn->session.resumes.lock());
  if (!target) {
    if (flags != 0 || count != 0) {
      return setup_protocol_error(conn, "a SESSION frame that answers no new session");
    }
    conn->acks.peer_wants_acks = true;
    return established(conn, capabilities(*conn));
  }
  if (flags == detail::SESSION_UNKNOWN) {
    // The peer's process restarted (or gave the session up): nothing more can be resumed.
    give_up(target,
            "the peer no longer knows the session (unknown session: its process "
            "restarted, or it gave the session up)");
    return false;
  }
  if (flags != detail::SESSION_RESUME) {
    return setup_protocol_error(conn, "a SESSION frame that answers no resume");
  }
  if (target->ending() || !target->session.down) {
    close(conn, "the session ended meanwhile", CloseCause::LOCAL, false);
    return false;
  }
  adopt(target, conn);
  conn->session.resumes.reset();
  close(conn, "its connection carries a resumed session", CloseCause::LOCAL, false);
  carry_on(target, session_frame(id, target->acks.delivered, 0, detail::SESSION_GO), count);
  (void)resumed(target, count);
  return false;  // the session's connection reads what follows
}

void Backend::adopt(const std::shared_ptr<Connection>& conn,
                    const std::shared_ptr<Connection>& carrier) {
  // The old one, if this side had not noticed it break.
  detach_transport(conn, CloseCause::SILENT);
  std::size_t max_send = 0;
  {
    const std::lock_guard lock{carrier->mutex};
    carrier->fd.close();
    max_send = carrier->max_send_message;
  }
  conn->socket = std::move(carrier->socket);
  conn->decoder.reset_to_frames();
  conn->decoder.set_max_message_size(m_max_message);
  conn->peer_sends_heartbeats = carrier->peer_sends_heartbeats;
  conn->peer_takes_heartbeats = carrier->peer_takes_heartbeats;
  conn->peer_says_goodbye = carrier->peer_says_goodbye;
  conn->goodbye_received = false;
  reset_stream_state(*conn);
  // What this side acknowledged is told by the resume's set-up.
  conn->acks.acked = conn->acks.delivered;
  conn->acks.bytes_unacked = 0;
  conn->acks.ack_due = false;
  const std::lock_guard lock{conn->mutex};
  conn->max_send_message = max_send;
  conn->fd = m_loop->add_fd(conn->socket.native_handle(), EPOLLIN, socket_callback(conn));
}

void Backend::carry_on(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> frame,
                       std::uint64_t peer_count) {
  {
    // With the sends' lock: a send from another thread lands after what is sent again.
    const std::lock_guard lock{conn->mutex};
    conn->ledger.send_again_from(peer_count);
    conn->queue.append_copy(frame);
    conn->queue.append_refs_from(conn->replay, conn->replay.start_of(peer_count));
    conn->session.down = false;
    conn->flush_pending = true;
  }
  // Written from the loop's next round, after resumed() was reported: a write that fails
  // then interrupts the session again, in that order.
  request_flush(conn);
}

void Backend::detach_transport(const std::shared_ptr<Connection>& conn, CloseCause /*cause*/) {
  {
    const std::lock_guard lock{conn->mutex};
    conn->fd.close();
    conn->queue.clear();
    conn->flush_pending = false;
    conn->receive_paused = false;
  }
  release_receive_memory(*conn);
  drain_and_close(conn->socket);
  conn->decoder.reset();
  conn->epollout = false;
  conn->awaiting_go = false;
}

std::shared_ptr<Connection> Backend::start_carrier(const std::shared_ptr<Connection>& conn,
                                                   std::string& why) {
  try {
    auto carrier = std::make_shared<Connection>(next_id(), m_io, m_chunks, m_bodies, conn->remote,
                                                conn->params, 0, Phase::CONNECTING);
    carrier->session.id = conn->session.id;
    why = connect_again(carrier->socket, conn->remote);
    if (!why.empty()) return nullptr;
    {
      const std::lock_guard lock{carrier->mutex};
      carrier->fd =
          m_loop->add_fd(carrier->socket.native_handle(), EPOLLOUT, socket_callback(carrier));
    }
    track_setup(carrier);
    return carrier;
  } catch (const std::exception& e) {
    // No memory or descriptor for it (epoll_ctl): this attempt fails like a refused one.
    why = e.what();
    return nullptr;
  }
}

std::shared_ptr<detail::ConnectionBase> Backend::resume_transport(
    const std::shared_ptr<Connection>& conn) {
  std::string why;
  auto carrier = start_carrier(conn, why);
  if (!carrier) {
    NETIO3_DEBUG("asyncmsg: resuming the connection with {}: {}", conn->remote, why);
    conn->session.reason = std::move(why);
    return nullptr;
  }
  carrier->session.resumes = conn;
  return carrier;
}

void Backend::say_farewell(const std::shared_ptr<Connection>& conn) noexcept {
  std::erase_if(m_farewells, [](const auto& c) { return c->phase >= Phase::CLOSING; });
  std::string why;
  auto carrier = start_carrier(conn, why);
  if (!carrier) {
    NETIO3_DEBUG("asyncmsg: cannot tell {} that the session ended: {}", conn->remote, why);
    return;
  }
  carrier->session.farewell = true;
  // What this side had handed to its application: the peer completes those sends rather
  // than listing them (as the acknowledgement before a goodbye does).
  carrier->session.farewell_count = conn->acks.delivered;
  try {
    m_farewells.push_back(std::move(carrier));
  } catch (const std::bad_alloc&) {
    NETIO3_DEBUG("asyncmsg: cannot tell {} that the session ended: out of memory", conn->remote);
  }
}

bool Backend::setup_protocol_error(const std::shared_ptr<Connection>& conn, std::string_view what) {
  const auto reason = fmt::format("protocol error: {}", what);
  NETIO3_WARN("asyncmsg: closing connection with {}: {}", conn->remote, reason);
  refuse(conn, RefusalCause::SETUP_FAILED, reason, CloseCause::PROTOCOL);
  return false;
}

}  // namespace netio3::asyncmsg
