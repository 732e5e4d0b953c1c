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

bool Backend::reconnect_from_new_source_port(const std::shared_ptr<Connection>& conn) {
  if (!detail::retry_from_new_source_port(*conn, NAME)) return false;
  tcp::socket fresh{*m_io};
  std::string why;
  try {
    if (const int err = start_connect(fresh, conn->remote); err != 0) {
      why = "connect failed: " + detail::errno_text(err);
    }
  } catch (const std::runtime_error& e) {
    why = e.what();
  }
  if (!why.empty()) {
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
  conn->epollout = false;
  conn->large_messages = false;
  conn->wake_threshold = 1;  // a new socket
  conn->queued_at_tick = 0;
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
  return established(conn, capabilities(*conn));
}

bool Backend::setup_protocol_error(const std::shared_ptr<Connection>& conn, std::string_view what) {
  const auto reason = fmt::format("protocol error: {}", what);
  NETIO3_WARN("asyncmsg: closing connection with {}: {}", conn->remote, reason);
  refuse(conn, RefusalCause::SETUP_FAILED, reason, CloseCause::PROTOCOL);
  return false;
}

}  // namespace netio3::asyncmsg
