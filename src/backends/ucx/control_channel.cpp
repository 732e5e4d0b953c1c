// UCX backend: the control channel (netio3's own TCP connection set-up, docs/ucx.md) and
// the UCP endpoints it leads to.

#include "backends/ucx/ucx_backend_impl.hpp"

namespace netio3::ucx {

void Backend::close_listener_socket(Listener& listener) noexcept {
  const std::lock_guard lock{listener.mutex};
  if (listener.closed) return;
  listener.closed = true;
  listener.fd.close();
  listener.resume.close();
  listener.socket.close();
}

void Backend::on_acceptable(const std::shared_ptr<Listener>& listener, std::uint32_t /*events*/) {
  for (int i = 0; i < ACCEPTS_PER_EVENT && !shut_down(); ++i) {
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    detail::Socket socket;
    {
      const std::lock_guard lock{listener->mutex};
      if (listener->closed) return;
      socket = detail::Socket{::accept4(listener->socket.get(),
                                        reinterpret_cast<sockaddr*>(&peer),  // NOLINT
                                        &len, SOCK_NONBLOCK | SOCK_CLOEXEC)};
    }
    if (!socket.valid()) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        detail::pause_accepting(*listener,
                                fmt::format("accept failed: {}", detail::errno_text(err)));
        return;
      }
      NETIO3_DEBUG("ucx: accept on {} failed: {}", listener->address, detail::errno_text(err));
      continue;
    }
    if (detail::descriptor_table_nearly_full(socket.get())) {
      // Accepting on would leave UCX (and the application) no descriptor: UCX's tcp
      // transport gives up its listener for good when its own accept fails.
      detail::pause_accepting(*listener, detail::descriptor_table_nearly_full_text(socket.get()) +
                                             "; the connection is refused");
      return;
    }
    listener->pauses->accepted();
    const auto remote = detail::to_endpoint_address(&peer, len);
    if (!remote) continue;
    accept_one(listener, std::move(socket), *remote);
  }
}

void Backend::accept_one(const std::shared_ptr<Listener>& listener, detail::Socket socket,
                         const EndPointAddress& remote) {
  if (const auto why = detail::configure_stream(socket.get(), m_config.limits.peer_timeout);
      !why.empty()) {
    NETIO3_WARN("ucx: cannot configure the connection from {} on {}: {}", remote, listener->address,
                why);
    return;
  }
  std::shared_ptr<Connection> conn;
  {
    const auto held = m_registry.lock();
    const auto admission = Engine::admission(held, *listener, remote);
    if (admission == Admission::LISTENER_CLOSED) return;
    if (admission == Admission::SOURCE_PORT_COLLISION) {
      // The refusal greeting tells a netio3 client to connect from another port.
      if (detail::send_now(socket.get(), detail::encode_refusal_greeting(CONTROL_PROTOCOL))) {
        m_lingering->add(std::move(socket));
      }
      return;
    }
    try {
      conn = make_connection(held, remote, listener->params, listener->id, Phase::HANDSHAKE,
                             listener->shared_recv ? listener->shared_recv : m_global_recv);
      m_registry.index(conn);
      const std::lock_guard lock{conn->mutex};
      conn->control = std::move(socket);
      conn->control_fd = m_loop->add_fd(conn->control.get(), EPOLLIN, control_callback(conn));
    } catch (const std::exception& e) {
      NETIO3_WARN("ucx: refusing a connection on {} from {}: {}", listener->address, remote,
                  e.what());
      if (conn) m_registry.forget(conn->id);
      return;
    }
    m_registry.add_connection(held, conn);
  }
  track_setup(conn);
  NETIO3_DEBUG("ucx: accepted a connection from {} on {}", remote, listener->address);
  conn->listener_address = listener->address;
  // The server greets at once; the client greets as soon as its connection is up.
  write_control(conn, opening(*conn));
}

std::vector<std::uint8_t> Backend::hello_frame(Connection& conn) const {
  return encode_hello_frame(
      Hello{.mode = m_config.mode == NetworkMode::RDMA ? std::uint8_t{1} : std::uint8_t{0},
            .max_message_size = m_config.limits.max_message_size,
            .token = conn.id,
            .worker_address = m_worker->address()});
}

std::vector<std::uint8_t> Backend::opening(Connection& conn) {
  auto out = admission_opening(conn, control_greeting(m_config.limits.max_message_size));
  // Without admission (or for a client without a key) the HELLO goes at once; otherwise it
  // follows this side's PROOF (a keyed client) or the server's verdict.
  if (conn.admission->hello_with_greeting()) {
    const auto frame = hello_frame(conn);
    out.insert(out.end(), frame.begin(), frame.end());
  }
  return out;
}

void Backend::write_control(const std::shared_ptr<Connection>& conn,
                            std::span<const std::uint8_t> bytes) {
  if (!conn->control.valid()) return;
  if (conn->control_out.empty()) {
    while (!bytes.empty()) {
      const ssize_t n =
          ::send(conn->control.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        bytes = bytes.subspan(static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      const auto reason =
          fmt::format("sending on the control connection failed: {}", detail::errno_text(errno));
      close(conn, reason, CloseCause::ERROR);
      return;
    }
    if (bytes.empty()) return;
  }
  conn->control_out.insert(conn->control_out.end(), bytes.begin(), bytes.end());
  const std::lock_guard lock{conn->mutex};
  conn->control_fd.modify(EPOLLIN | EPOLLOUT);
}

void Backend::flush_control(const std::shared_ptr<Connection>& conn) {
  std::vector<std::uint8_t> pending = std::move(conn->control_out);
  conn->control_out.clear();
  {
    const std::lock_guard lock{conn->mutex};
    conn->control_fd.modify(EPOLLIN);
  }
  write_control(conn, pending);
}

void Backend::on_control_event(const std::shared_ptr<Connection>& conn, std::uint32_t events) {
  if (shut_down() || !conn->control.valid()) return;
  if (conn->phase == Phase::CONNECTING) {
    if (const auto failure = detail::connect_failure(conn->control.get())) {
      refuse(conn, RefusalCause::UNREACHABLE, *failure);
      return;
    }
    {
      const std::lock_guard lock{conn->mutex};
      conn->phase = Phase::HANDSHAKE;
      conn->control_fd.modify(EPOLLIN);
    }
    m_greeting_deadlines->track(conn);
    write_control(conn, opening(*conn));
    return;
  }
  if ((events & EPOLLOUT) != 0 && !conn->control_out.empty()) {
    flush_control(conn);
    if (shut_down() || !conn->control.valid()) return;
  }
  if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) != 0) read_control(conn);
}

bool Backend::control_active(const Connection& conn) const noexcept {
  return !shut_down() && conn.control.valid() &&
         (conn.phase == Phase::HANDSHAKE || conn.phase == Phase::OPEN);
}

void Backend::read_control(const std::shared_ptr<Connection>& conn) {
  std::array<std::uint8_t, 4096> buffer{};
  for (int i = 0; i < READS_PER_EVENT; ++i) {
    const ssize_t n = ::recv(conn->control.get(), buffer.data(), buffer.size(), MSG_DONTWAIT);
    if (n > 0) {
      ++conn->arrivals;
      const auto status = conn->decoder.feed(
          std::span<const std::uint8_t>{buffer.data(), static_cast<std::size_t>(n)},
          [&](const detail::Greeting& greeting) { return on_control_greeting(conn, greeting); },
          [&](std::span<const std::uint8_t> frame) { return on_control_frame(conn, frame); });
      if (!control_active(*conn)) return;
      if (status == detail::FrameDecoder::Status::ERROR) {
        if (conn->decoder.refused_address_in_use() && conn->phase == Phase::HANDSHAKE &&
            !conn->greeted && reconnect_from_new_source_port(conn)) {
          return;
        }
        if (conn->decoder.greeting_rejected()) conn->refusal = RefusalCause::REJECTED;
        protocol_error_now(conn, conn->decoder.error());
        return;
      }
      if (static_cast<std::size_t>(n) < buffer.size()) return;
      continue;
    }
    if (n == 0) {
      on_control_end(conn, "the peer closed the control connection");
      return;
    }
    const int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) return;
    if (err == EINTR) continue;
    on_control_end(conn, fmt::format("the control connection failed: {}", detail::errno_text(err)));
    return;
  }
}

bool Backend::reconnect_from_new_source_port(const std::shared_ptr<Connection>& conn) {
  if (!detail::retry_from_new_source_port(*conn, NAME)) return false;
  detail::ConnectStart started;
  std::string why;
  try {
    started = detail::connect_tcp(conn->remote, m_config.limits.peer_timeout);
    if (started.error != 0) why = "connect failed: " + detail::errno_text(started.error);
  } catch (const std::runtime_error& e) {
    why = e.what();
  }
  if (!why.empty()) {
    NETIO3_WARN("ucx: connecting again to {}: {}", conn->remote, why);
    return false;
  }
  conn->control_out.clear();
  conn->decoder.reset();
  conn->decoder.set_max_message_size(detail::MAX_ADMISSION_FRAME);
  const std::lock_guard lock{conn->mutex};
  conn->control_fd.close();
  conn->control = std::move(started.socket);
  conn->phase = Phase::CONNECTING;
  conn->control_fd = m_loop->add_fd(conn->control.get(), EPOLLOUT, control_callback(conn));
  return true;
}

void Backend::protocol_error_now(const std::shared_ptr<Connection>& conn, const std::string& why) {
  NETIO3_WARN("ucx: closing connection with {}: {}", conn->remote, why);
  close(conn, why, CloseCause::PROTOCOL);
}

bool Backend::on_control_frame(const std::shared_ptr<Connection>& conn,
                               std::span<const std::uint8_t> frame) {
  const std::uint8_t type = conn->decoder.frame_type();
  if (const auto go_on = admission_frame(conn, type, frame)) [[unlikely]] {
    return *go_on;
  }
  if (!conn->admission->admitted()) [[unlikely]] {
    protocol_error_now(conn, fmt::format("a {} frame before the connection was admitted",
                                         type == FRAME_HELLO   ? "HELLO"
                                         : type == FRAME_CLOSE ? "CLOSE"
                                                               : "HEARTBEAT"));
    return false;
  }
  if (type == FRAME_HELLO) {
    on_hello(conn, frame);
  } else if (conn->decoder.frame_type() == FRAME_HEARTBEAT) {
    if (!frame.empty()) {
      protocol_error_now(conn, fmt::format("a HEARTBEAT of {} bytes", frame.size()));
    }
  } else {
    const auto total = decode_close(frame);
    if (!total) {
      protocol_error_now(conn, fmt::format("a CLOSE of {} bytes", frame.size()));
    } else if (!conn->greeted) {
      protocol_error_now(conn, "CLOSE before HELLO");
    } else if (!conn->peer_total) {
      // The peer closed: deliver what it sent, up to its BYE (service_inbox), within
      // close_timeout.
      conn->peer_total = *total;
      m_peer_close_deadlines->track(conn);
      mark_dirty(*conn);
    }
  }
  return control_active(*conn);
}

bool Backend::on_control_greeting(const std::shared_ptr<Connection>& conn,
                                  const detail::Greeting& greeting) {
  // 3.2 and later send heartbeats and accept them (older peers: TCP keepalive on this
  // channel, detail::configure_stream).
  conn->peer_sends_heartbeats = greeting.minor >= HEARTBEAT_MINOR;
  conn->peer_takes_heartbeats = conn->peer_sends_heartbeats;
  return admission_greeting(conn, greeting);
}

bool Backend::admitted(const std::shared_ptr<Connection>& conn) {
  // A keyed client sends its HELLO (its worker address and token) only now, once the server
  // proved the key: a listener without it learns neither. (A server's HELLO went with its
  // verdict: add_to_verdict.)
  if (conn->active() && !conn->admission->hello_with_greeting()) {
    write_control(conn, hello_frame(*conn));
    if (!control_active(*conn)) return false;
  }
  // The peer's HELLO may now be read.
  conn->decoder.set_max_message_size(MAX_CONTROL_FRAME);
  return control_active(*conn);
}

void Backend::add_to_verdict(Connection& conn, std::vector<std::uint8_t>& frames) const {
  // The server's HELLO, behind its PROOF (a client older than 3.3 waits for the HELLO alone).
  const auto hello = hello_frame(conn);
  frames.insert(frames.end(), hello.begin(), hello.end());
}

void Backend::refuse_and_linger(Connection& conn, std::span<const std::uint8_t> refusal) {
  if (!conn.control.valid() || !conn.control_out.empty()) return;
  if (!refusal.empty()) (void)detail::send_now(conn.control.get(), refusal);
  linger_control(conn, false);
}

bool Backend::setup_protocol_error(const std::shared_ptr<Connection>& conn, std::string_view what) {
  protocol_error_now(conn, std::string{what});
  return false;
}

void Backend::send_heartbeat(const std::shared_ptr<Connection>& conn) {
  // Not once the peer announced its close: it half-closed and is finishing.
  if (conn->phase != Phase::OPEN || conn->peer_total || !conn->control.valid()) return;
  std::array<std::uint8_t, detail::FRAME_HEADER_SIZE> frame{};
  detail::encode_frame_header(frame.data(), 0, FRAME_HEARTBEAT);
  write_control(conn, frame);
}

void Backend::on_hello(const std::shared_ptr<Connection>& conn,
                       std::span<const std::uint8_t> frame) {
  if (conn->greeted || conn->phase != Phase::HANDSHAKE) {
    protocol_error_now(conn, "a second HELLO");
    return;
  }
  std::string error;
  const auto hello = decode_hello(frame, error);
  if (!hello) {
    protocol_error_now(conn, error);
    return;
  }
  const auto address = parse_worker_address(hello->worker_address);
  if (!address.error.empty()) {
    protocol_error_now(conn, fmt::format("HELLO with {}", address.error));
    return;
  }
  if (const auto bad = check_transport_addresses(address, m_own_address); !bad.empty()) {
    protocol_error_now(conn, fmt::format("HELLO with {}", bad));
    return;
  }
  if (impersonates(address, m_own_address)) {
    // UCX would connect to itself and keep that connection.
    protocol_error_now(conn,
                       "HELLO with a worker address that names this process's own UCX "
                       "transports under another worker's id");
    return;
  }
  // Only now, with the peer's HELLO accepted, does the connection get its buffers.
  try {
    provision(*conn);
  } catch (const std::exception& e) {
    const auto reason = fmt::format("cannot allocate the connection's buffers: {}", e.what());
    NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
    close(conn, reason, CloseCause::ERROR);
    return;
  }
  std::shared_ptr<Endpoint> endpoint;
  try {
    endpoint = acquire_endpoint(hello->worker_address, address, conn->remote);
  } catch (const std::runtime_error& e) {
    const auto reason = fmt::format("cannot reach the peer over UCX: {}", e.what());
    NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
    close(conn, reason, CloseCause::ERROR);
    return;
  }
  endpoint->users.push_back(conn);
  conn->greeted = true;
  conn->by_cma = endpoint->by_cma;
  {
    const std::lock_guard lock{conn->mutex};
    conn->ep = std::move(endpoint);
    conn->peer_token = hello->token;
    conn->peer_max = hello->max_message_size;
  }
  NETIO3_DEBUG("ucx: {} speaks protocol {}, accepts messages up to {} bytes ({} mode)",
               conn->remote, PROTOCOL_VERSION, hello->max_message_size,
               hello->mode == 1 ? "rdma" : "tcp");
  // Our first message over UCX; the connection is established on each side when the
  // other's has arrived, which proves that UCX reaches the peer (service_inbox).
  const auto ready = send_control(*conn, MessageType::READY);
  if (ready != UCS_OK) {
    const auto reason = fmt::format("sending READY failed: {}", status_text(ready));
    NETIO3_WARN("ucx: connection with {}: {}", conn->remote, reason);
    close(conn, reason, CloseCause::ERROR);
    return;
  }
  mark_dirty(*conn);  // the peer's READY may be here already
}

void Backend::on_control_end(const std::shared_ptr<Connection>& conn, const std::string& how) {
  if (conn->peer_total) {
    // After CLOSE: the messages it announced are still arriving. The socket stays, no longer
    // watched (its end stays readable), until this side closes after the last of them: only
    // then does the peer see this side's end (linger_control), and a peer that is shutting
    // down waits for it before it lets go of its UCX endpoint (see shutdown()).
    const std::lock_guard lock{conn->mutex};
    conn->control_fd.close();
    return;
  }
  drop_control(*conn);
  if (conn->phase != Phase::OPEN) {
    close(conn, how, CloseCause::ERROR);
    return;
  }
  // No CLOSE first, which a live netio3 peer always sends, also when it closes after an
  // error: its process ended. Its worker is gone with it, and what this side still sends
  // there would wait for UCX to notice (shared memory: its keepalive, tens of seconds).
  // The endpoint to it is closed by force at once - it was proven by this connection's
  // READY, so it is the dead process's - which ends every connection with that worker;
  // what arrived complete is delivered first (service_inbox).
  const auto why = fmt::format("{} without closing first (its process ended?)", how);
  std::shared_ptr<Endpoint> endpoint;
  {
    const std::lock_guard lock{conn->mutex};
    endpoint = conn->ep;
  }
  if (endpoint) {
    close_endpoint(endpoint, why);
  } else {
    on_ep_error(conn, why);
  }
}

void Backend::drop_control(Connection& conn) noexcept {
  {
    const std::lock_guard lock{conn.mutex};
    conn.control_fd.close();
  }
  conn.control_out.clear();
  detail::drain_and_close(conn.control);
}

void Backend::linger_control(Connection& conn, bool awaited) {
  {
    const std::lock_guard lock{conn.mutex};
    conn.control_fd.close();
  }
  if (!conn.control_out.empty()) {
    conn.control_out.clear();
    detail::drain_and_close(conn.control);
    return;
  }
  if (conn.control.valid()) m_lingering->add(std::move(conn.control), awaited);
}

std::shared_ptr<Endpoint> Backend::acquire_endpoint(std::span<const std::uint8_t> address,
                                                    const WorkerAddressInfo& info,
                                                    const EndPointAddress& remote) {
  std::string peer{address.begin(), address.end()};
  if (const auto it = m_peers.find(peer); it != m_peers.end()) return it->second;
  // Bulk data by CMA only where the kernel lets both processes read each other; else the
  // endpoint is made as if the peer had no CMA (its large messages go over tcp).
  std::vector<std::uint8_t> without_cma;
  const auto refusal = cma_refusal(info, m_own_address);
  if (!refusal.empty()) {
    NETIO3_INFO("ucx: connection with {}: large messages by tcp, not CMA: {}", remote, refusal);
    without_cma = without_transport(address, info, m_own_address, cma_checksum());
    address = without_cma;
  }
  auto endpoint = std::make_shared<Endpoint>(++m_endpoint_ids, peer);
  endpoint->by_cma = refusal.empty() && cma_on_one_host(info, m_own_address);
  endpoint->backend = this;
  endpoint->last_progress = std::chrono::steady_clock::now();
  // UCX reads the address without knowing its length: a copy with room behind it, so that
  // a truncated address cannot make it read beyond the buffer.
  std::vector<std::uint8_t> padded(address.size() + 4096, 0);
  std::copy(address.begin(), address.end(), padded.begin());
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(padded.data());  // NOLINT
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Backend::ep_error_callback;
  params.err_handler.arg = endpoint.get();
  check("ucp_ep_create", ucp_ep_create(m_worker->get(), &params, &endpoint->handle));
  m_endpoints.emplace(endpoint->id, endpoint);
  m_peers.emplace(std::move(peer), endpoint);
  NETIO3_DEBUG("ucx: a new endpoint to a peer worker ({} in all)", m_endpoints.size());
  return endpoint;
}

void Backend::release_endpoint(Connection& conn) {
  std::shared_ptr<Endpoint> endpoint;
  {
    const std::lock_guard lock{conn.mutex};
    conn.ep_released = true;
    endpoint = std::move(conn.ep);
  }
  if (!endpoint) return;
  std::erase_if(endpoint->users, [&](const std::weak_ptr<Connection>& user) {
    const auto c = user.lock();
    return !c || c.get() == &conn;
  });
  // An endpoint to a worker that never answered over UCX (a peer that never set up a
  // connection, or one that sent a worker address of someone else) is not kept: a flood of
  // such HELLOs must not pile up endpoints.
  if (endpoint->users.empty() && !endpoint->proven) {
    close_endpoint(endpoint, "no connection through it was ever set up");
  }
}

void Backend::close_endpoint(const std::shared_ptr<Endpoint>& endpoint, const std::string& why) {
  if (endpoint->closing) return;
  endpoint->closing = true;
  if (const auto it = m_peers.find(endpoint->peer); it != m_peers.end() && it->second == endpoint) {
    m_peers.erase(it);
  }
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &Backend::ep_close_callback;
  param.user_data = endpoint.get();
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  NETIO3_DEBUG("ucx: closing an endpoint by force ({} connection(s) on it): {}",
               endpoint->users.size(), why);
  // Under each user's lock, which every send holds: no thread is in ucp_am_send_nbx on the
  // endpoint once this loop is done, and none starts (post()).
  for (const auto& user : endpoint->users) {
    if (auto conn = user.lock()) {
      const std::lock_guard lock{conn->mutex};
      conn->ep_closing = true;
    }
  }
  void* const request = ucp_ep_close_nbx(endpoint->handle, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {
    push_event(Event{.kind = Event::Kind::EP_CLOSED, .id = endpoint->id});
  }
  const auto users = endpoint->users;
  for (const auto& user : users) {
    if (auto conn = user.lock()) on_ep_error(conn, why);
    if (shut_down()) return;
  }
}

void Backend::on_endpoint_closed(std::uint64_t id, ucs_status_t status) {
  const auto it = m_endpoints.find(id);
  if (it == m_endpoints.end()) return;
  const auto endpoint = it->second;
  m_endpoints.erase(it);
  NETIO3_DEBUG("ucx: an endpoint closed{} ({} left)",
               status == UCS_OK ? std::string{} : fmt::format(": {}", status_text(status)),
               m_endpoints.size());
  const auto users = endpoint->users;
  for (const auto& user : users) {
    const auto conn = user.lock();
    if (!conn) continue;
    {
      const std::lock_guard lock{conn->mutex};
      conn->ep_gone = true;
    }
    if (conn->phase == Phase::CLOSING) advance_close(conn);
    if (shut_down()) return;
  }
}

void Backend::on_endpoint_error(std::uint64_t id, ucs_status_t status) {
  const auto it = m_endpoints.find(id);
  if (it == m_endpoints.end()) return;
  const auto endpoint = it->second;
  endpoint->failed = true;
  // UCX's status says how its transport noticed (a reset reads "Endpoint timeout" on tcp),
  // not why the peer went.
  close_endpoint(endpoint, fmt::format("the connection to the peer's worker was lost (UCX: {})",
                                       status_text(status)));
}

}  // namespace netio3::ucx
