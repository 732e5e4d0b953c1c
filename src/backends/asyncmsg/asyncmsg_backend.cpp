// asyncmsg: TCP through Boost.Asio sockets, driven by the shared EpollEventLoop.
//
// Asio provides the sockets (address parsing, open/bind/listen/accept, options, error
// codes); readiness comes from the shared epoll loop, so no io_context is ever run and no
// thread is hidden. Connect is issued with ::connect on the native handle because Asio's
// synchronous connect would block in poll() on a non-blocking socket.
//
// Threads: socket I/O, state transitions and every callback happen on the loop thread.
// Other threads only append to a connection's SendQueue under its mutex and ask the loop
// to flush it; the loop writes outside the lock (see send_queue.hpp).
//
// Lock order: the registry before Connection::mutex before BufferPool's mutex. No user
// callback is ever called while one of them is held.

#include "backends/asyncmsg/asyncmsg_backend_impl.hpp"

namespace netio3::asyncmsg {

void Backend::start() {
  start_engine();
  std::weak_ptr<Backend> weak = weak_from_this();
  m_flush_signal = m_loop->create_signal([weak] {
    if (auto self = weak.lock()) self->process_flush_list();
  });
  m_prepare = m_loop->add_prepare_hook([weak] {
    auto self = weak.lock();
    return !self || self->process_flush_list();
  });
  m_lingering.emplace(*m_loop, LINGER_TIMEOUT);
}

void Backend::shutdown() noexcept {
  if (!begin_shutdown()) return;
  const auto all = take_everything();
  for (auto& listener : all.listeners) close_acceptor(*listener);
  for (auto& conn : all.connections) abandon(*conn);
  if (m_lingering) m_lingering->close_all();
  m_flush_signal.close();
  m_prepare.close();
  m_registry.clear_index();
  m_sessions.clear();
  for (auto& farewell : std::exchange(m_farewells, {})) abandon(*farewell);
  NETIO3_DEBUG("asyncmsg: backend shut down ({} listener(s), {} connection(s) dropped)",
               all.listeners.size(), all.connections.size());
}

EndPointAddress Backend::open_listen_endpoint(const EndPointAddress& address,
                                              const ConnectionParameters& params) {
  const ApiCall call = open_call(address, params, true);
  const auto ip = asio::ip::make_address(address.address);
  const auto held = m_registry.lock();
  if (address.port != 0) m_registry.check_listen_free(held, address);
  auto listener = std::make_shared<Listener>(next_id(), address, params, m_io);
  boost::system::error_code ec;
  const tcp::endpoint endpoint{ip, address.port};
  const auto fail = [&](std::string_view step) {
    throw FailedOpenListenEndpoint(
        fmt::format("asyncmsg: cannot listen on {}: {} failed: {}", address, step, ec.message()));
  };
  if (listener->acceptor.open(endpoint.protocol(), ec); ec) fail("open");
  if (listener->acceptor.set_option(tcp::acceptor::reuse_address(true), ec); ec)
    fail("SO_REUSEADDR");
  if (listener->acceptor.bind(endpoint, ec); ec) fail("bind");
  if (listener->acceptor.listen(asio::socket_base::max_listen_connections, ec); ec) fail("listen");
  if (listener->acceptor.non_blocking(true, ec); ec) fail("non-blocking mode");
  const auto local = listener->acceptor.local_endpoint(ec);
  if (ec) fail("getsockname");
  EndPointAddress actual{address.address, local.port()};
  m_registry.check_listen_free(held, actual);
  listener->address = actual;
  listener->pauses.emplace(NAME, actual);
  {
    // The first event may be dispatched before add_fd returns: publish the handle under
    // the listener's mutex, which the loop takes before using it.
    const std::lock_guard listener_lock{listener->mutex};
    listener->resume = detail::make_resume_timer(*m_loop, listener);
    listener->fd = m_loop->add_fd(listener->acceptor.native_handle(), EPOLLIN,
                                  fd_callback<&Backend::on_acceptable>(listener));
  }
  m_registry.add_listener(held, actual, std::move(listener));
  NETIO3_DEBUG("asyncmsg: listening on {}", actual);
  return actual;
}

void Backend::open_active_endpoint(const EndPointAddress& address,
                                   const ConnectionParameters& params) {
  const ApiCall call = open_call(address, params, false);
  const auto held = m_registry.lock();
  m_registry.check_connection_free(held, address);
  auto conn = std::make_shared<Connection>(next_id(), m_io, m_chunks, m_bodies, address, params, 0,
                                           Phase::CONNECTING);
  if (conn->session.enabled) conn->session.id = new_session_id();
  attach_send_pool(*conn);
  int err = 0;
  try {
    err = start_connect(conn->socket, address);
  } catch (const std::runtime_error& e) {
    throw FailedOpenActiveEndpoint(
        fmt::format("asyncmsg: cannot connect to {}: {}", address, e.what()));
  }
  if (err != 0) {
    // Failed at once (e.g. no route): reported like any refusal, from the loop.
    m_registry.add_connection(held, conn);
    refuse_later(conn, RefusalCause::UNREACHABLE,
                 fmt::format("connect failed: {}", detail::errno_text(err)));
    return;
  }
  // Writable = connected or failed; on_socket_event tells which from SO_ERROR. The
  // event may be dispatched before add_fd returns, so the handle is published under the
  // connection's mutex, which the loop takes before using it.
  {
    const std::lock_guard conn_lock{conn->mutex};
    conn->fd = m_loop->add_fd(conn->socket.native_handle(), EPOLLOUT, socket_callback(conn));
  }
  m_registry.add_connection(held, conn);
  track_setup(conn);
  NETIO3_DEBUG("asyncmsg: connecting to {}", address);
}

NetioStatus Backend::post_data(const std::shared_ptr<Connection>& conn,
                               std::span<const std::uint8_t> header, std::span<const iovec> iov,
                               Payload payload, detail::PendingSend pending) {
  std::size_t size = header.size();
  for (const auto& v : iov) size += v.iov_len;
  return enqueue(conn, size, pending, [&](SendQueue& queue) {
    std::array<std::uint8_t, FRAME_HEADER_SIZE> frame{};
    encode_frame_header(frame.data(), static_cast<std::uint32_t>(size));
    queue.append_copy(frame);
    queue.append_copy(header);
    for (const auto& v : iov) {
      const std::span<const std::uint8_t> part{static_cast<const std::uint8_t*>(v.iov_base),
                                               v.iov_len};
      if (payload == Payload::COPY) {
        queue.append_copy(part);
      } else {
        queue.append_ref(part);
      }
    }
  });
}

NetioStatus Backend::post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer) {
  const std::size_t size = buffer->size();
  std::uint8_t* frame = detail::BufferPool::headroom_of(buffer, FRAME_HEADER_SIZE);
  return enqueue(conn, size, detail::PendingSend{buffer->id(), buffer}, [&](SendQueue& queue) {
    encode_frame_header(frame, static_cast<std::uint32_t>(size));
    queue.append_ref({frame, FRAME_HEADER_SIZE + size});
  });
}

void Backend::close_transport(const std::shared_ptr<Connection>& conn) {
  const auto& ending = conn->ending_info;
  {
    const std::lock_guard lock{conn->mutex};
    if (ending.cause == CloseCause::LOCAL && ending.was_open) say_goodbye(*conn);
    conn->receive_paused = false;
    conn->queue.clear();
    conn->replay.clear();
    conn->flush_pending = false;
    conn->fd.close();
  }
  release_receive_memory(*conn);
  if (conn->session.enabled && !conn->active()) {
    const std::string id{conn->session.id.begin(), conn->session.id.end()};
    if (const auto it = m_sessions.find(id); it != m_sessions.end() && it->second.lock() == conn) {
      m_sessions.erase(it);
    }
  }
  if ((ending.cause == CloseCause::LOCAL && ending.was_open) || conn->linger_on_close) {
    linger(*conn);
  } else {
    drain_and_close(conn->socket);
  }
}

void Backend::say_goodbye(Connection& conn) noexcept {
  // Only where the stream is between two frames: with bytes still queued (sends the close
  // cancels) the peer reads the end in the middle of a message, or without a goodbye, as a
  // connection that broke. Nothing queued means nothing is being written: 8 bytes, written at
  // once (a send buffer without room for them leaves the peer reading a lost peer).
  if (!conn.peer_says_goodbye || !conn.queue.empty() || !conn.socket.is_open()) {
    return;
  }
  std::array<std::uint8_t, FRAME_HEADER_SIZE> frame{};
  encode_frame_header(frame.data(), 0, detail::FRAME_GOODBYE);
  if (!detail::send_now(conn.socket.native_handle(), frame)) {
    NETIO3_DEBUG("asyncmsg: goodbye to {} not written whole", conn.remote);
  }
}

void Backend::abandon(Connection& conn) noexcept {
  {
    const std::lock_guard lock{conn.mutex};
    if (conn.phase == Phase::OPEN) say_goodbye(conn);  // destroyed: an orderly end for the peer
    conn.fd.close();
    conn.phase = Phase::CLOSED;
    conn.ledger.cancel_all();
    conn.queue.clear();
    conn.replay.clear();
  }
  drain_and_close(conn.socket);
  if (auto carrier = std::exchange(conn.session.carrier, nullptr)) {
    abandon(static_cast<Connection&>(*carrier));
  }
}

void Backend::request_flush(const std::shared_ptr<Connection>& conn) {
  bool was_empty = false;
  {
    const std::lock_guard lock{m_flush_mutex};
    was_empty = m_flush_list.empty();
    m_flush_list.push_back(conn);
  }
  // On the loop thread the prepare hook flushes before the loop sleeps again.
  if (was_empty && !m_loop->in_loop_thread()) m_flush_signal.fire();
}

EndpointCapabilities Backend::capabilities(const Connection& conn) {
  return EndpointCapabilities{.send_buffered = conn.send_pool != nullptr,
                              .send_copy = true,
                              .send_zero_copy = true,
                              .receive = true};
}

void Backend::close_acceptor(Listener& listener) noexcept {
  const std::lock_guard lock{listener.mutex};
  if (listener.closed) return;
  listener.closed = true;
  listener.fd.close();
  listener.resume.close();
  boost::system::error_code ec;
  listener.acceptor.close(ec);
}

void Backend::on_socket_event(const std::shared_ptr<Connection>& conn, std::uint32_t events) {
  assert_loop_thread();
  if (shut_down() || conn->ending()) return;
  // A close was requested from another thread and is posted to this loop: nothing more is
  // read (a decoder stopped by the request dropped the rest of its input, so the stream
  // cannot be parsed any further) and nothing more is written.
  if (conn->close_requested.load(std::memory_order_relaxed)) return;
  if (conn->phase == Phase::CONNECTING) {
    on_connect_done(conn);
    return;
  }
  if (conn->receive_paused && (events & (EPOLLERR | EPOLLHUP)) != 0) {
    NETIO3_WARN("asyncmsg: connection with {} failed while waiting for receive memory",
                conn->remote);
    close(conn, "connection failed while waiting for receive memory", CloseCause::ERROR);
    return;
  }
  if (!conn->receive_paused && (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) != 0) {
    on_readable(conn);
    // CONNECTING: refused, and connecting again on a new socket.
    if (shut_down() || conn->ending() || conn->phase == Phase::CONNECTING) return;
  }
  if ((events & EPOLLOUT) != 0) flush(conn, std::chrono::steady_clock::now() + FLUSH_BUDGET);
}

bool Backend::on_message(const std::shared_ptr<Connection>& conn,
                         std::span<const std::uint8_t> message) {
  const std::uint8_t type = conn->decoder.frame_type();
  if (conn->awaiting_go && type != detail::FRAME_SESSION) [[unlikely]] {
    return protocol_violation(conn, "a frame before the GO of the resumed session");
  }
  if (type == detail::FRAME_GOODBYE || conn->goodbye_received) [[unlikely]] {
    return on_goodbye(conn, type, message);
  }
  if (const auto go_on = admission_frame(conn, type, message)) [[unlikely]] {
    return *go_on;
  }
  if (type == detail::FRAME_SESSION) [[unlikely]] {
    return on_session(conn, message);
  }
  if (conn->setting_up() && !conn->ending() && !shut_down() &&
      !conn->close_requested.load(std::memory_order_relaxed)) [[unlikely]] {
    return setup_protocol_error(conn, fmt::format("a {} frame before the connection was admitted",
                                                  type == detail::FRAME_DATA  ? "DATA"
                                                  : type == detail::FRAME_ACK ? "ACK"
                                                                              : "HEARTBEAT"));
  }
  if (!still_open(*conn)) return false;
  if (type == detail::FRAME_ACK) [[unlikely]] {
    if (message.size() == detail::ACK_BODY_SIZE) {
      return acknowledgement(conn, detail::load_le64(message.data()));
    }
    return protocol_violation(conn,
                              fmt::format("an ACK frame with {} bytes of body", message.size()));
  }
  if (type == detail::FRAME_HEARTBEAT) [[unlikely]] {
    if (message.empty()) return true;
    return protocol_violation(
        conn, fmt::format("a heartbeat frame with {} bytes of body", message.size()));
  }
  conn->large_messages = message.size() >= FrameDecoder::DIRECT_MIN;
  return deliver(*conn, message);
}

bool Backend::on_goodbye(const std::shared_ptr<Connection>& conn, std::uint8_t type,
                         std::span<const std::uint8_t> message) {
  if (shut_down() || conn->ending() || conn->close_requested.load()) return false;
  if (conn->setting_up()) {
    return setup_protocol_error(conn, "a GOODBYE frame before the connection was admitted");
  }
  std::string problem;
  if (conn->goodbye_received) {
    problem = fmt::format("a frame of type {} after the peer's GOODBYE", type);
  } else if (!message.empty()) {
    problem = fmt::format("a GOODBYE frame with {} bytes of body", message.size());
  }
  if (!problem.empty()) return protocol_violation(conn, problem);
  // The peer's end of the stream follows (it closes after writing this).
  conn->goodbye_received = true;
  return true;
}

void Backend::send_heartbeat(const std::shared_ptr<Connection>& conn) {
  std::array<std::uint8_t, FRAME_HEADER_SIZE> frame{};
  encode_frame_header(frame.data(), 0, detail::FRAME_HEARTBEAT);
  send_control(conn, frame, false);
}

bool Backend::send_ack(const std::shared_ptr<Connection>& conn, std::uint64_t count) {
  std::array<std::uint8_t, FRAME_HEADER_SIZE + detail::ACK_BODY_SIZE> frame{};
  encode_frame_header(frame.data(), detail::ACK_BODY_SIZE, detail::FRAME_ACK);
  detail::store_le64(frame.data() + FRAME_HEADER_SIZE, count);
  // Also from the application's close (the engine sends the last count before the goodbye,
  // while the connection is still open but close_requested may be set).
  send_control(conn, frame, true);
  return true;
}

void Backend::send_control(const std::shared_ptr<Connection>& conn,
                           std::span<const std::uint8_t> frame, bool closing_too) {
  bool need_flush = false;
  {
    const std::lock_guard lock{conn->mutex};
    // Not while a session is interrupted: the resume's set-up tells the counts.
    if (conn->phase != Phase::OPEN || conn->session.down ||
        (!closing_too && conn->close_requested.load(std::memory_order_relaxed))) {
      return;
    }
    std::span<const std::uint8_t> rest{frame};
    if (conn->queue.empty()) {
      // Idle (the usual case): written at once. The socket is written on the loop thread
      // only, and nothing is queued, so no write is in progress.
      const ssize_t n = ::send(conn->socket.native_handle(), frame.data(), frame.size(),
                               MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) rest = rest.subspan(static_cast<std::size_t>(n));
      if (rest.empty()) return;
    }
    // Between two messages (appends are whole messages), outside max_unsent_bytes: a few
    // bytes a period or a round. A failed write is found again (and reported) by the flush.
    conn->queue.append_copy(rest);
    need_flush = !std::exchange(conn->flush_pending, true);
  }
  if (need_flush) request_flush(conn);
}

void Backend::on_readable(const std::shared_ptr<Connection>& conn) {
  read_available(conn);
  if (!shut_down() && !conn->ending() && conn->socket.is_open()) set_wake_threshold(*conn);
}

void Backend::set_wake_threshold(Connection& conn) {
  const std::size_t rest = conn.decoder.body_remaining();
  const int wanted = rest >= FrameDecoder::DIRECT_MIN && !conn.receive_paused
                         ? static_cast<int>(std::min(rest, WAKE_THRESHOLD_MAX))
                         : 1;
  if (wanted == conn.wake_threshold) return;
  if (!apply_wake_threshold(conn, wanted)) {
    // Raising it is an optimisation: without it the loop is woken as data come. Lowering it
    // must not fail silently (the old threshold may ask for bytes that never come): it is
    // tried again whenever the loop stops reading this connection.
    if (wanted < conn.wake_threshold) {
      NETIO3_WARN("asyncmsg: connection with {}: SO_RCVLOWAT {} failed: {}", conn.remote, wanted,
                  detail::errno_text(errno));
    } else {
      NETIO3_DEBUG("asyncmsg: connection with {}: SO_RCVLOWAT {}: {}", conn.remote, wanted,
                   detail::errno_text(errno));
    }
  }
}

bool Backend::apply_wake_threshold(Connection& conn, int wanted) {
  const int fd = conn.socket.native_handle();
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &wanted, sizeof wanted) != 0) return false;
  conn.wake_threshold = wanted;
  conn.queued_at_tick = 0;
  return true;
}

bool Backend::receiving(const Connection& conn) {
  if (conn.receive_paused) return false;
  if (conn.wake_threshold <= 1) return true;
  // asio's native_handle() is not const, although it only reads the descriptor.
  const int fd = const_cast<tcp::socket&>(conn.socket).native_handle();
  int queued = 0;
  if (::ioctl(fd, FIONREAD, &queued) != 0) return true;
  const bool grew = queued != conn.queued_at_tick;
  conn.queued_at_tick = queued;
  return !grew;
}

namespace {
// Sets a flag for its lifetime.
class Flag {
 public:
  explicit Flag(bool& flag) noexcept : m_flag{flag} { m_flag = true; }
  ~Flag() { m_flag = false; }
  Flag(const Flag&) = delete;
  Flag& operator=(const Flag&) = delete;
  Flag(Flag&&) = delete;
  Flag& operator=(Flag&&) = delete;

 private:
  bool& m_flag;
};
}  // namespace

void Backend::read_available(const std::shared_ptr<Connection>& conn) {
  if (conn->reading) return;  // a write inside one of its callbacks found the peer's end
  const Flag reading{conn->reading};
  if (!m_scratch) m_scratch = std::make_unique_for_overwrite<std::uint8_t[]>(SCRATCH_SIZE);
  const int fd = conn->socket.native_handle();
  const auto on_greeting_cb = [&](const Greeting& g) { return on_greeting(conn, g); };
  const auto on_message_cb = [&](std::span<const std::uint8_t> message) {
    return on_message(conn, message);
  };
  const auto admit_cb = [&](std::size_t length) { return admit(*conn, length); };
  for (int i = 0; i < READS_PER_EVENT; ++i) {
    std::span<std::uint8_t> target = conn->decoder.direct_target();
    const bool direct = !target.empty();
    if (!direct) {
      // In a stream of large messages, read a frame header alone: the body then goes
      // straight into its message instead of partly through the scratch buffer (one
      // small read instead of copying what a full read brought of the body).
      const bool header_only = conn->large_messages && conn->decoder.at_frame_start();
      target = {m_scratch.get(), header_only ? FRAME_HEADER_SIZE : SCRATCH_SIZE};
    }
    const ssize_t n = ::recv(fd, target.data(), target.size(), MSG_DONTWAIT);
    if (n > 0) {
      ++conn->arrivals;
      const auto got = static_cast<std::size_t>(n);
      const auto status =
          direct ? conn->decoder.commit_direct(got, on_message_cb)
                 : conn->decoder.feed(target.first(got), on_greeting_cb, on_message_cb, admit_cb);
      // Ended, or (a session) interrupted or handed to another connection while decoding.
      if (shut_down() || conn->ending() || !conn->socket.is_open()) return;
      if (!after_decode(conn, status)) return;
      if (got < target.size()) return;  // drained for now
      continue;
    }
    if (n == 0) {
      if (conn->decoder.mid_item()) {
        // Abnormal: the peer vanished in the middle of a message; the part is dropped.
        NETIO3_WARN("asyncmsg: connection with {} closed by the peer in the middle of a message",
                    conn->remote);
        close(conn,
              "the peer's end of the connection came in the middle of a message (a peer "
              "that vanished)",
              CloseCause::ERROR);
      } else if (conn->setting_up()) {
        close(conn, "the peer closed the connection before its netio3 greeting", CloseCause::PEER);
      } else if (conn->peer_says_goodbye && !conn->goodbye_received) {
        close(conn, detail::ENDED_WITHOUT_GOODBYE, CloseCause::ERROR);
      } else {
        close(conn, "peer closed the connection", CloseCause::PEER);
      }
      return;
    }
    const int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) return;
    if (err == EINTR) continue;
    if (conn->goodbye_received && !conn->decoder.mid_item()) {
      // The peer said goodbye and then reset (its process closed with bytes of ours unread):
      // as orderly an end as its FIN.
      close(conn, "peer closed the connection", CloseCause::PEER);
      return;
    }
    NETIO3_WARN("asyncmsg: connection with {}: receive failed: {}", conn->remote,
                detail::errno_text(err));
    close(conn, fmt::format("receive failed: {}", detail::errno_text(err)), CloseCause::ERROR);
    return;
  }
}

bool Backend::process_flush_list() {
  assert_loop_thread();
  {
    const std::lock_guard lock{m_flush_mutex};
    if (m_flush_list.empty()) return true;
    m_flush_work.swap(m_flush_list);
  }
  const auto deadline = std::chrono::steady_clock::now() + FLUSH_BUDGET;
  for (const auto& conn : m_flush_work) {
    if (shut_down()) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      request_flush(conn);  // its turn comes on the next round of the loop
    } else {
      flush(conn, deadline);
    }
  }
  m_flush_work.clear();
  const std::lock_guard lock{m_flush_mutex};
  return m_flush_list.empty();
}

void Backend::set_epollout(Connection& conn, bool on) {
  if (conn.epollout == on) return;
  conn.epollout = on;
  update_events(conn);
}

void Backend::update_events(Connection& conn) {
  const std::uint32_t events =
      (conn.receive_paused ? 0U : std::uint32_t{EPOLLIN}) | (conn.epollout ? EPOLLOUT : 0U);
  const std::lock_guard lock{conn.mutex};
  if (conn.fd) conn.fd.modify(events);  // none: a session between two transport connections
}

bool Backend::admit(Connection& conn, std::size_t length) {
  // The set-up's frames are bounded by the decoder (detail::MAX_ADMISSION_FRAME), not counted.
  if (conn.setting_up()) return true;
  release_receive_memory(conn);  // a new body: the previous one is complete
  if (length > m_config.limits.max_receive_memory - m_receive_reserved) return false;
  m_receive_reserved += length;
  conn.reserved = length;
  return true;
}

void Backend::release_receive_memory(Connection& conn) {
  if (conn.reserved == 0) return;
  m_receive_reserved -= conn.reserved;
  conn.reserved = 0;
  if (!m_receive_waiting.empty() && !m_resume_posted) {
    m_resume_posted = true;
    std::weak_ptr<Backend> weak = weak_from_this();
    m_loop->post([weak] {
      if (auto self = weak.lock()) self->resume_waiting();
    });
  }
}

void Backend::pause_receiving(const std::shared_ptr<Connection>& conn) {
  NETIO3_DEBUG("asyncmsg: connection with {}: waiting for receive memory ({} of {} bytes held)",
               conn->remote, m_receive_reserved, m_config.limits.max_receive_memory);
  conn->receive_paused = true;
  update_events(*conn);
  m_receive_waiting.push_back(conn);
}

void Backend::resume_waiting() {
  m_resume_posted = false;
  while (!m_receive_waiting.empty() && !shut_down()) {
    const auto conn = m_receive_waiting.front().lock();
    if (!conn || conn->ending() || !conn->receive_paused) {
      m_receive_waiting.pop_front();
      continue;
    }
    const auto status = conn->decoder.resume(
        [&](const Greeting& g) { return on_greeting(conn, g); },
        [&](std::span<const std::uint8_t> message) { return on_message(conn, message); },
        [&](std::size_t length) { return admit(*conn, length); });
    if (shut_down()) return;
    // Still first in line (perhaps with a later message of the kept bytes).
    if (status == FrameDecoder::Status::PAUSED) return;
    m_receive_waiting.pop_front();
    conn->receive_paused = false;
    if (conn->ending()) continue;
    if (after_decode(conn, status)) {
      set_wake_threshold(*conn);
      update_events(*conn);
    }
  }
}

bool Backend::after_decode(const std::shared_ptr<Connection>& conn, FrameDecoder::Status status) {
  if (conn->reserved > 0 && !conn->decoder.in_body()) release_receive_memory(*conn);
  switch (status) {
    case FrameDecoder::Status::OK:
      return true;
    case FrameDecoder::Status::ERROR:
      if (conn->decoder.refused_address_in_use() && conn->phase == Phase::HANDSHAKE &&
          reconnect_from_new_source_port(conn)) {
        return false;
      }
      NETIO3_WARN("asyncmsg: closing connection with {}: {}", conn->remote, conn->decoder.error());
      refuse(
          conn,
          conn->decoder.greeting_rejected() ? RefusalCause::REJECTED : RefusalCause::SETUP_FAILED,
          conn->decoder.error(), CloseCause::PROTOCOL);
      return false;
    case FrameDecoder::Status::STOPPED:
      return false;
    case FrameDecoder::Status::PAUSED:
      pause_receiving(conn);
      return false;
  }
  return false;
}

void Backend::flush(const std::shared_ptr<Connection>& conn,
                    std::chrono::steady_clock::time_point deadline) {
  std::array<iovec, MAX_IOV> iov{};
  // The lists of what one write finished are kept between calls, per thread (the loop's):
  // allocated in every call, a write of thousands of small messages freed its lists and
  // touched fresh memory each time (glibc handed it back with madvise; the loop paid the
  // TLB shootdowns and page faults: -11% msg/s for 64 B copy sends). Borrowed for the call
  // (a flush inside a completion callback finds them empty and makes its own) and given
  // back even when a callback destroyed the backend: thread storage outlives it.
  thread_local std::vector<detail::SendLedger::Ticket> kept_tickets;
  thread_local std::vector<detail::PendingSend> kept_sends;
  struct Borrowed {
    std::vector<detail::SendLedger::Ticket> tickets{std::move(kept_tickets)};
    std::vector<detail::PendingSend> sends{std::move(kept_sends)};
    Borrowed() = default;
    Borrowed(const Borrowed&) = delete;
    Borrowed& operator=(const Borrowed&) = delete;
    Borrowed(Borrowed&&) = delete;
    Borrowed& operator=(Borrowed&&) = delete;
    ~Borrowed() {
      tickets.clear();
      sends.clear();
      if (tickets.capacity() > kept_tickets.capacity()) kept_tickets = std::move(tickets);
      if (sends.capacity() > kept_sends.capacity()) kept_sends = std::move(sends);
    }
  } borrowed;
  auto& finished = borrowed.tickets;
  auto& finished_sends = borrowed.sends;
  for (int round = 0; round < WRITES_PER_FLUSH; ++round) {
    std::size_t count = 0;
    {
      const std::lock_guard lock{conn->mutex};
      if (conn->ending()) return;
      // Once the application asked to close, nothing more is handed to the kernel: what
      // was queued at that moment is reported as cancelled, deterministically.
      if (!conn->close_requested.load(std::memory_order_relaxed)) {
        count = conn->queue.gather(
            iov.data(), iov.size(),
            std::min(MAX_WRITE_BYTES, conn->queue.bytes_for_messages(MESSAGES_PER_WRITE)));
      }
      if (count == 0) conn->flush_pending = false;
    }
    if (count == 0) {
      set_epollout(*conn, false);
      return;
    }
    msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = count;
    const ssize_t n = ::sendmsg(conn->socket.native_handle(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        set_epollout(*conn, true);
        return;
      }
      if ((err == EPIPE || err == ECONNRESET) && !conn->setting_up() && !conn->reading) {
        // The peer's end. What it sent before it is read first: its messages are delivered,
        // and its goodbye, if it said one, makes this the orderly close it was (a peer that
        // closed with bytes of ours unread resets; the write may see that first).
        read_available(conn);
        if (shut_down() || conn->ending() || !conn->socket.is_open()) return;
      }
      NETIO3_WARN("asyncmsg: connection with {}: send failed: {}", conn->remote,
                  detail::errno_text(err));
      close(conn, fmt::format("send failed: {}", detail::errno_text(err)), CloseCause::ERROR);
      return;
    }
    finished.clear();
    finished_sends.clear();
    {
      const std::lock_guard lock{conn->mutex};
      conn->queue.consume(static_cast<std::size_t>(n), finished);
      for (const auto ticket : finished) {
        detail::PendingSend done;
        if (conn->ledger.complete(ticket, done)) finished_sends.push_back(done);
      }
    }
    for (const auto& done : finished_sends) {
      if (!completed(*conn, done)) return;
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
  }
  // Still data after a full round, or the time is up: give other connections and the
  // loop's other work a turn, come back soon.
  request_flush(conn);
}

void Backend::linger(Connection& conn) {
  // The lingering socket waits for the peer's FIN reading whatever comes: every byte wakes it.
  if (conn.wake_threshold > 1) (void)apply_wake_threshold(conn, 1);
  boost::system::error_code ec;
  const int fd = conn.socket.release(ec);
  if (ec) {
    drain_and_close(conn.socket);
    return;
  }
  m_lingering->add(detail::Socket{fd});
}

std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                               std::shared_ptr<BaseEventLoop> loop) {
  return std::make_unique<detail::BackendFacade<Backend>>(std::move(config), std::move(loop));
}

}  // namespace netio3::asyncmsg
