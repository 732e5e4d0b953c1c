// UCX: active messages on one UCP worker per backend, driven by the shared EpollEventLoop
// through the worker's event fd. When the fd is readable, or before the loop would sleep,
// the worker is progressed until it has nothing left, then armed (ucp_worker_arm; BUSY
// means: progress again). No thread of our own, no polling.
//
// Connections (protocol version 3, docs/ucx.md). netio3 sets up its connections itself; UCX's
// listener and connection manager are not used (one malformed packet made them abort the
// process). A listen endpoint is netio3's own TCP socket on the loop. The client connects to
// it and both sides send a greeting and a HELLO on this TCP connection - the control channel -
// with their limits, a connection token and their UCP worker's address, all checked before
// anything is allocated for them. Each side then makes a UCP endpoint from the other's worker
// address, so UCX chooses its lanes (shared memory between processes of one host, RDMA where
// there is some, tcp otherwise), and reports the connection established. The control channel
// stays open: a close announces on it how many messages were sent, and its end (EOF, reset)
// tells at once that the peer's process died.
//
// Endpoints. UCX pairs the endpoints of two workers by the order in which each side created
// them, not by netio3's connection. All connections between two workers therefore share one
// UCP endpoint on each side (the first each side makes: they pair), and every active message
// carries the receiver's connection token, by which it is routed. The shared endpoint stays
// until it fails or the backend goes: closing it would fail its pair on the peer, which may
// be in use. A connection's close waits for its own sends; if the peer takes nothing at all
// for limits.close_timeout, the endpoint is closed by force, which ends every connection with
// that peer (it is not reading).
//
// UCX calls back only from inside ucp_worker_progress, and those callbacks only record: an
// arriving message goes into its connection's inbox, everything else into an event queue. The
// application's callbacks run afterwards, outside UCX, so they may send, close or destroy the
// backend.
//
// Messages: the receiver delivers strictly by sequence number, so a small eager message that
// overtakes an earlier rendezvous one waits in the inbox. Eager data is kept by UCX
// (persistent data) and handed to on_data_cb from UCX's buffer; rendezvous data is first
// received into a receive-pool buffer (or, when none fits, a heap buffer bounded by
// limits.max_message_size).
//
// Closing: a local close sends BYE (the last active message) and CLOSE on the control channel,
// waits at most limits.close_timeout for its sends to complete (forcing the endpoint closed
// after that), and reports; the peer closes once it has delivered everything before the BYE.

#include "backends/ucx/ucx_backend_impl.hpp"
#include "common/environment.hpp"

namespace netio3::ucx {

void Backend::start() {
  if (const auto budget =
          detail::microseconds_from_environment("NETIO3_UCX_PROGRESS_BUDGET_US", NAME)) {
    m_progress_budget = *budget;
  }
  start_engine();
  std::weak_ptr<Backend> weak = weak_from_this();
  m_kick = m_loop->create_signal([weak] {
    if (auto self = weak.lock()) {
      self->m_kick_pending.store(false);
      self->progress();
    }
  });
  m_greeting_deadlines.emplace(
      *m_loop, NAME,
      std::min<std::chrono::milliseconds>(m_config.limits.connect_timeout, SERVER_GREETING_TIMEOUT),
      // The greeting itself: with admission the server's HELLO comes only after the exchange
      // (and its accept hook), which connect_timeout bounds.
      [](const Connection& conn) {
        return conn.phase == Phase::HANDSHAKE && !conn.decoder.greeted();
      },
      [weak](const std::shared_ptr<Connection>& conn, const std::string& reason) {
        if (auto self = weak.lock()) {
          const auto why = fmt::format(
              "{}: the server did not greet (it is not a netio3 ucx backend of protocol {} or "
              "later; older ones listen with UCX's connection manager)",
              reason, PROTOCOL_VERSION);
          NETIO3_WARN("ucx: connection to {}: {}", conn->remote, why);
          self->refuse(conn, RefusalCause::TIMED_OUT, why);
        }
      },
      "waiting for the server's greeting", false);
  m_close_deadlines.emplace(
      *m_loop, NAME, m_config.limits.close_timeout,
      [](const Connection& conn) { return conn.phase == Phase::CLOSING && !conn.ep_released; },
      [weak](const std::shared_ptr<Connection>& conn, const std::string&) {
        if (auto self = weak.lock()) self->close_timed_out(conn);
      },
      "closing", false);
  m_peer_close_deadlines.emplace(
      *m_loop, NAME, m_config.limits.close_timeout,
      [](const Connection& conn) {
        return conn.phase == Phase::HANDSHAKE || conn.phase == Phase::OPEN;
      },
      [weak](const std::shared_ptr<Connection>& conn, const std::string&) {
        if (auto self = weak.lock()) self->peer_close_timed_out(conn);
      },
      "the peer's close", false);
  // At least close_timeout: the shutdown waits that long for the ends it awaits.
  m_lingering.emplace(
      *m_loop, std::max<std::chrono::milliseconds>(LINGER_TIMEOUT, m_config.limits.close_timeout));
}

void Backend::shutdown() noexcept {
  if (!begin_shutdown()) return;
  const auto all = take_everything();
  m_prepare.close();
  m_kick.close();
  m_efd.close();
  for (auto* deadlines : {&m_greeting_deadlines, &m_close_deadlines, &m_peer_close_deadlines}) {
    if (*deadlines) (*deadlines)->close();
  }
  for (auto& listener : all.listeners) close_listener_socket(*listener);
  // Every connection UCX may still hold something of (closed ones too: m_closing).
  std::vector<std::shared_ptr<Connection>> conns = m_registry.indexed();
  if (!m_worker) {
    // Never connected or listened: nothing of UCX's to wind down.
    for (const auto& conn : conns) drop_control(*conn);
    if (m_lingering) m_lingering->close_all();
    NETIO3_DEBUG("ucx: backend shut down");
    return;
  }
  // From here on, what UCX reports only settles request counts.
  const auto settle = [&] {
    std::vector<Event> reported;
    {
      const std::lock_guard lock{m_events_mutex};
      reported.swap(m_events);
    }
    for (const auto& event : reported) {
      if (event.kind == Event::Kind::EP_CLOSED) {
        m_endpoints.erase(event.id);
        continue;
      }
      if (event.kind != Event::Kind::SEND_DONE) continue;
      const auto it = std::find_if(conns.begin(), conns.end(),
                                   [&](const auto& c) { return c->id == event.id; });
      if (it == conns.end()) continue;
      const std::lock_guard lock{(*it)->mutex};
      --(*it)->requests;
      release_op(**it, (*it)->ops[event.slot]);
    }
  };
  settle();
  ucp_worker_h worker = m_worker->get();
  auto deadline = std::chrono::steady_clock::now() + m_config.limits.close_timeout;
  const auto progress_until = [&](const auto& done) {
    for (settle(); !done() && std::chrono::steady_clock::now() < deadline; settle()) {
      if (ucp_worker_progress(worker) != 0 || ucp_worker_arm(worker) != UCS_OK) continue;
      pollfd fd{m_worker->event_fd(), POLLIN, 0};
      ::poll(&fd, 1, 10);
    }
  };
  // Open connections get BYE, so that their peers close at once once they have
  // delivered what came before it. No send is accepted from here on.
  std::vector<std::shared_ptr<Connection>> announced;
  for (const auto& conn : conns) {
    Phase previous{};
    {
      const std::lock_guard lock{conn->mutex};
      previous = conn->phase;
      conn->phase = Phase::CLOSED;
      conn->ledger.cancel_all();
    }
    if (previous == Phase::OPEN && conn->peer_error.empty() &&
        send_control(*conn, MessageType::BYE) == UCS_OK) {
      announced.push_back(conn);
    }
  }
  // Rendezvous receives in flight must end before their endpoints close (UCX aborts
  // otherwise), and BYE must be out before the endpoints close gracefully.
  progress_until([&] {
    return std::all_of(conns.begin(), conns.end(), [](const auto& c) {
      const std::lock_guard lock{c->mutex};
      return c->receiving == 0 && c->requests == 0;
    });
  });
  // The peers learn how many messages to expect, then the end of the control channel.
  for (const auto& conn : conns) {
    if (std::find(announced.begin(), announced.end(), conn) != announced.end() &&
        conn->control.valid()) {
      (void)detail::send_now(conn->control.get(), encode_close(conn->tx_seq));
    }
    drop_control(*conn);
  }
  // Connections closed here before with messages sent: their peers end the control channel
  // once every message arrived. Until then the endpoints stay: UCX over tcp may carry the two
  // directions to a peer on two sockets (when the peer's UCX address is that of an earlier
  // process this worker talked to, the two sides' numbering of their connections disagrees),
  // and a peer that sees one of them end fails the endpoint and drops what is still unread on
  // the other - the tail of the stream of a sender that exits after its close.
  if (m_lingering) {
    progress_until([&] { return m_lingering->reap_awaited() == 0; });
    m_lingering->close_all();
  }
  // Every endpoint is closed, gracefully where a connection still used it (a forced close
  // can lose what UCX reported sent), without callbacks. One that no connection uses any
  // more holds nothing in flight (the closes of its connections flushed it): it is closed at
  // once, as it would be by the end of the process. Gracefully it would wait for its peer
  // worker to answer, which a peer in this same process - another backend on this loop,
  // which nothing progresses while this one shuts down - never does before close_timeout.
  // One whose connections still have requests after close_timeout (rendezvous sends to a
  // peer that does not fetch them: stopped, hung) is closed by force, which ends them: UCX
  // 1.13 aborts the process when a worker is destroyed with such a request on an endpoint
  // (ucp_ep_destroy_base asserts that the endpoint's protocol requests are gone).
  // A receive still in flight (a rendezvous the peer does not serve: stopped, hung) belongs
  // to a connection that may have left its endpoint's users already (closed, its message
  // being discarded): every endpoint is then closed by force, for the same reason.
  const bool receiving = std::any_of(conns.begin(), conns.end(), [](const auto& c) {
    const std::lock_guard lock{c->mutex};
    return c->receiving > 0;
  });
  std::vector<void*> closing;
  for (const auto& [id, endpoint] : m_endpoints) {
    if (endpoint->closing || endpoint->handle == nullptr) continue;
    endpoint->closing = true;
    bool idle = true;
    bool busy = receiving;
    for (const auto& user : endpoint->users) {
      const auto conn = user.lock();
      if (!conn) continue;
      idle = false;
      const std::lock_guard lock{conn->mutex};
      busy = busy || conn->requests > 0 || conn->receiving > 0;
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags =
        endpoint->failed || idle || busy ? static_cast<unsigned>(UCP_EP_CLOSE_FLAG_FORCE) : 0U;
    void* const request = ucp_ep_close_nbx(endpoint->handle, &param);
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) closing.push_back(request);
  }
  // Closes that were under way before the shutdown complete through their callbacks. The
  // closes get their own time (a forced one needs a few progress calls), not what the sends
  // left of close_timeout.
  deadline = std::max(deadline, std::chrono::steady_clock::now() + CLOSE_PROGRESS);
  progress_until([&] {
    return std::all_of(closing.begin(), closing.end(), [](void* request) {
      return ucp_request_check_status(request) != UCS_INPROGRESS;
    });
  });
  for (void* request : closing) {
    if (ucp_request_check_status(request) == UCS_INPROGRESS) {
      NETIO3_WARN("ucx: an endpoint did not close within {} ms",
                  m_config.limits.close_timeout.count());
    }
    ucp_request_free(request);
  }
  for (const auto& conn : conns) {
    for (auto& slot : conn->inbox) {
      if (slot.stage != Incoming::Stage::RECEIVING) release(*conn, slot);
    }
    conn->region_map = MemoryMap{};
    conn->send_map = MemoryMap{};
    unmap_staging(*conn);
    if (conn->recv) conn->recv->map = MemoryMap{};
  }
  for (const auto& listener : all.listeners) {
    if (listener->shared_recv) listener->shared_recv->map = MemoryMap{};
  }
  if (m_global_recv) m_global_recv->map = MemoryMap{};
  if (m_delivering != nullptr && m_delivering->desc != nullptr) {
    ucp_am_data_release(worker, std::exchange(m_delivering->desc, nullptr));
  }
  m_shared_send_map = MemoryMap{};
  {
    const std::lock_guard lock{m_events_mutex};
    m_events.clear();
  }
  m_dirty.clear();
  m_closing.clear();
  m_peers.clear();
  m_endpoints.clear();
  m_registry.clear_index();
  // No callback can come after this; connections that outlive us hold no UCX resource.
  m_worker.reset();
  NETIO3_DEBUG("ucx: backend shut down");
}

EndPointAddress Backend::open_listen_endpoint(const EndPointAddress& address,
                                              const ConnectionParameters& params) {
  const ApiCall call = open_call(address, params, true);
  const auto fail = [&](std::string_view why) {
    return FailedOpenListenEndpoint(fmt::format("ucx: cannot listen on {}: {}", address, why));
  };
  if (!detail::to_socket_address(address)) throw fail("not a numeric IP address");
  try {
    ensure_worker(address, true);
  } catch (const std::runtime_error& e) {
    throw fail(e.what());
  }
  const auto held = m_registry.lock();
  if (address.port != 0) m_registry.check_listen_free(held, address);
  auto listener = std::make_shared<Listener>(next_id(), address, params);
  try {
    if (params.recv_params.use_shared_receive_buffers) {
      listener->shared_recv = std::make_shared<RecvPool>(
          m_worker->context(), params.recv_params.num_buf, params.recv_params.buf_size);
    }
    auto [socket, bound] = detail::listen_tcp(address);
    m_registry.check_listen_free(held, bound);
    listener->address = bound;
    listener->pauses.emplace(NAME, bound);
    const std::lock_guard lock{listener->mutex};
    listener->socket = std::move(socket);
    listener->resume = detail::make_resume_timer(*m_loop, listener);
    listener->fd = m_loop->add_fd(listener->socket.get(), EPOLLIN,
                                  fd_callback<&Backend::on_acceptable>(listener));
  } catch (const ListenEndpointAlreadyExists&) {
    throw;
  } catch (const std::runtime_error& e) {
    throw fail(e.what());
  }
  EndPointAddress actual = listener->address;
  warn_if_off_devices(actual, true);
  m_registry.add_listener(held, actual, std::move(listener));
  NETIO3_DEBUG("ucx: listening on {}", actual);
  return actual;
}

void Backend::open_active_endpoint(const EndPointAddress& address,
                                   const ConnectionParameters& params) {
  const ApiCall call = open_call(address, params, false);
  if (!detail::to_socket_address(address)) {
    throw InvalidEndpointAddress(fmt::format("ucx: {} is not a numeric IP address", address));
  }
  const auto fail = [&](std::string_view why) {
    return FailedOpenActiveEndpoint(fmt::format("ucx: cannot connect to {}: {}", address, why));
  };
  try {
    ensure_worker(address, false);
  } catch (const std::runtime_error& e) {
    throw fail(e.what());
  }
  warn_if_off_devices(address, false);
  std::shared_ptr<Connection> conn;
  int error = 0;
  {
    const auto held = m_registry.lock();
    m_registry.check_connection_free(held, address);
    try {
      conn = make_connection(held, address, params, 0, Phase::CONNECTING, m_global_recv);
      provision(*conn);
      auto started = detail::connect_tcp(address, m_config.limits.peer_timeout);
      error = started.error;
      // Findable by its token before the loop can see the socket: the peer's first message
      // may arrive before this call returns.
      m_registry.index(conn);
      const std::lock_guard lock{conn->mutex};
      conn->control = std::move(started.socket);
      if (error == 0) {
        conn->control_fd = m_loop->add_fd(conn->control.get(), EPOLLOUT, control_callback(conn));
      }
    } catch (const InvalidConnectionParameters&) {
      if (conn) m_registry.forget(conn->id);
      throw;
    } catch (const std::runtime_error& e) {
      if (conn) m_registry.forget(conn->id);
      throw fail(e.what());
    }
    m_registry.add_connection(held, conn);
  }
  if (error != 0) {
    // Failed at once (no route, ...): reported like any refusal, from the loop.
    refuse_later(conn, RefusalCause::UNREACHABLE,
                 fmt::format("connect failed: {}", detail::errno_text(error)));
    return;
  }
  track_setup(conn);
  NETIO3_DEBUG("ucx: connecting to {}", address);
}

void Backend::ensure_worker(const EndPointAddress& first, bool listening) {
  const std::lock_guard lock{m_worker_mutex};
  if (m_worker) return;
  std::string devices;
  if (const char* env = std::getenv("UCX_NET_DEVICES"); env == nullptr || *env == '\0') {
    const auto iface = listening ? detail::interface_holding(first.address)
                                 : detail::interface_towards(first.address);
    if (iface) {
      devices = *iface;
      m_devices_interface = *iface;
      // Shared memory is not a network device: RDMA mode keeps it, and every InfiniBand /
      // RoCE port (which open no sockets).
      if (m_config.mode == NetworkMode::RDMA) devices += rdma_ports();
    }
  }
  try {
    m_worker = std::make_unique<Worker>(m_transports, m_config.thread_safety, devices);
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                         UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = AM_ID;
    handler.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    handler.cb = &Backend::am_callback;
    handler.arg = this;
    check("ucp_worker_set_am_recv_handler",
          ucp_worker_set_am_recv_handler(m_worker->get(), &handler));
    // UCX 1.13 grows its table of handlers without initialising the new entries (in
    // ucp_worker_set_am_handler_common the loop meant for each new slot initialises the new id's
    // slot over and over): a message on another id below the table's size calls whatever the
    // memory held, and any worker that reaches this one can send it. Every id up to
    // STRANGER_AM_IDS gets a handler that drops (registered in increasing order, the table ends
    // at exactly that size: it doubles from AM_ID + 1 and rounds to even sizes).
    handler.flags = 0;
    handler.cb = &Backend::stranger_am_callback;
    for (unsigned id = 0; id < STRANGER_AM_IDS; ++id) {
      if (id == AM_ID) continue;
      handler.id = id;
      check("ucp_worker_set_am_recv_handler",
            ucp_worker_set_am_recv_handler(m_worker->get(), &handler));
    }
    m_own_address = parse_worker_address(m_worker->address());
    if (!m_own_address.error.empty()) {
      NETIO3_WARN(
          "ucx: this UCX's own worker address does not parse as netio3 expects ({}): "
          "peers' addresses will be refused",
          m_own_address.error);
    }
    if (m_shared_send_pool) {
      m_shared_send_map = MemoryMap{m_worker->context(), m_shared_send_pool->region()};
    }
    const auto& rx = m_config.shared_receive_buffers;
    if (rx.use_shared_receive_buffers) {
      m_global_recv = std::make_shared<RecvPool>(m_worker->context(), rx.num_buf, rx.buf_size);
    }
  } catch (const std::runtime_error& e) {
    m_shared_send_map = MemoryMap{};
    m_global_recv.reset();
    m_worker.reset();
    throw std::runtime_error(fmt::format("ucx: cannot start UCX: {}", e.what()));
  }
  std::weak_ptr<Backend> weak = weak_from_this();
  m_efd = m_loop->add_fd(m_worker->event_fd(), EPOLLIN, [weak](std::uint32_t) {
    if (auto self = weak.lock()) self->progress();
  });
  m_prepare = m_loop->add_polling_hook([weak] {
    auto self = weak.lock();
    return !self || self->may_sleep();
  });
  NETIO3_DEBUG("ucx: UCX started, network devices {}, worker address of {} bytes",
               devices.empty() ? std::string{"chosen by UCX"} : devices,
               m_worker->address().size());
}

std::string Backend::rdma_ports() {
  std::string ports;
  const std::string root = "/sys/class/infiniband";
  DIR* devices = ::opendir(root.c_str());
  if (devices == nullptr) return ports;
  while (const dirent* device = ::readdir(devices)) {
    if (device->d_name[0] == '.') continue;
    const std::string dir = root + "/" + device->d_name + "/ports";
    DIR* list = ::opendir(dir.c_str());
    if (list == nullptr) continue;
    while (const dirent* port = ::readdir(list)) {
      if (port->d_name[0] != '.') ports += fmt::format(",{}:{}", device->d_name, port->d_name);
    }
    ::closedir(list);
  }
  ::closedir(devices);
  return ports;
}

void Backend::warn_if_off_devices(const EndPointAddress& address, bool listening) const {
  if (m_devices_interface.empty()) return;
  const auto iface = listening ? detail::interface_holding(address.address)
                               : detail::interface_towards(address.address);
  if (!iface || *iface == m_devices_interface) return;
  NETIO3_WARN(
      "ucx: {} {} goes through {}, but UCX's transports were set up on {} only (the "
      "interface of the backend's first endpoint); peers that cannot reach {} will fail to "
      "connect: set UCX_NET_DEVICES to the interfaces the backend needs",
      listening ? "listen endpoint" : "connection to", address, *iface, m_devices_interface,
      m_devices_interface);
}

std::shared_ptr<Connection> Backend::make_connection(const Registry::Lock& held,
                                                     const EndPointAddress& remote,
                                                     const ConnectionParameters& params,
                                                     std::uint64_t listener_id, Phase initial,
                                                     std::shared_ptr<RecvPool> shared) {
  auto conn =
      std::make_shared<Connection>(new_token(held), remote, params, listener_id, safe(), initial);
  conn->backend = this;
  conn->recv = std::move(shared);
  return conn;
}

void Backend::provision(Connection& conn) {
  // Both sides read the peer's HELLO (on_hello); a client's connection has its buffers from
  // connect already, and an application thread may be using them.
  if (conn.provisioned) return;
  conn.provisioned = true;
  const auto& params = conn.params;
  if (!conn.recv && params.recv_params.num_buf > 0) {
    conn.recv = std::make_shared<RecvPool>(m_worker->context(), params.recv_params.num_buf,
                                           params.recv_params.buf_size);
  }
  const auto& zc = params.send_zero_copy_params;
  if (zc.mr_start != nullptr && zc.buf_size > 0) {
    conn.region = {zc.mr_start, zc.buf_size};
    conn.region_map = MemoryMap{m_worker->context(), conn.region};
  }
  detail::attach_send_pool(conn, m_shared_send_pool.get(), 0, safe());
  if (conn.own_send_pool) {
    conn.send_map = MemoryMap{m_worker->context(), conn.own_send_pool->region()};
    conn.send_memh = conn.send_map.get();
  } else if (conn.send_pool != nullptr) {
    conn.send_memh = m_shared_send_map.get();
  }
}

std::uint64_t Backend::new_token(const Registry::Lock& held) {
  while (true) {
    const std::uint64_t token = detail::random_u64();
    if (token != 0 && !m_registry.id_in_use(held, token)) return token;
  }
}

EndpointCapabilities Backend::capabilities(const Connection& conn) {
  return EndpointCapabilities{.send_buffered = conn.send_pool != nullptr,
                              .send_copy = true,
                              .send_zero_copy = !conn.region.empty(),
                              .receive = true};
}

std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                               std::shared_ptr<BaseEventLoop> loop) {
  return std::make_unique<detail::BackendFacade<Backend>>(std::move(config), std::move(loop));
}

}  // namespace netio3::ucx
