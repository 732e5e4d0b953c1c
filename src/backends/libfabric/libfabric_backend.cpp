// libfabric: connection-oriented endpoints (FI_EP_MSG), driven by the shared EpollEventLoop
// through the wait fds of one event queue (connection management) and one completion queue
// (all transfers) per domain. Before the loop sleeps, fi_trywait gets every EQ and CQ of
// the backend; nothing polls and no thread is hidden (progress is manual: it happens when
// the loop reads the queues).
//
// Memory: receive buffers, send buffers, the zero-copy region and a small pool of header
// slots are registered once (fi_mr_reg), honouring the provider's mr_mode. A message goes
// out as one fi_send (buffered) or fi_sendv (header slot + payload, zero-copy). Each side
// announces its receive buffer size in the connection data, so a sender refuses a message
// the peer could only truncate.
//
// Lifetimes: every posted operation carries an Op (first member: the provider's
// fi_context2), and each connection counts the operations the provider holds
// (provider_ops). fi_close on an endpoint turns what is still posted into cancellation
// completions that point to its Ops, so a closed connection is retired and freed once its
// count is zero (see release_retired for providers that drop operations instead).
//
// Threads: callbacks, completions and connection-management events run on the loop
// thread. With ThreadSafetyModel::SAFE the provider is opened FI_THREAD_SAFE and any thread
// may post sends; with UNSAFE it is FI_THREAD_DOMAIN, the connection locks are off, and
// every call must come from the loop thread (checked).

#include "backends/libfabric/libfabric_backend_impl.hpp"
#include "common/send_failure.hpp"

namespace netio3::libfabric {

void Backend::start() {
  start_engine();
  std::weak_ptr<Backend> weak = weak_from_this();
  m_prepare = m_loop->add_polling_hook([weak] {
    auto self = weak.lock();
    return !self || self->may_sleep();
  });
  m_kick = m_loop->create_signal([weak] {
    if (auto self = weak.lock()) self->on_kick();
  });
  m_closed_listeners.emplace(*m_loop, m_config.limits.connect_timeout, [weak](Listener& listener) {
    if (auto self = weak.lock()) self->release_listener(listener);
  });
}

void Backend::shutdown() noexcept {
  if (!begin_shutdown()) return;
  auto all = take_everything();
  m_prepare.close();
  m_kick.close();
  for (auto& handles : m_domain_fds) {
    handles.eq.close();
    handles.cq.close();
  }
  // Connection requests still queued own an fi_info and a provider handle (leaked
  // otherwise), and their clients wait for an answer: each is refused now.
  for (const auto& domain : m_domains) refuse_queued_requests(*domain);
  // Destroyed inside the accept hook: the request it was asked about is refused too.
  std::optional<Deciding> deciding;
  {
    const std::lock_guard lock{m_pep_mutex};
    deciding.swap(m_deciding);
  }
  if (deciding) {
    if (!deciding->answered) {
      refuse_request(*deciding->listener->domain, deciding->listener.get(), deciding->request);
    }
    // The request's listener is held by the call that runs the hook, until after the domains
    // went: its shared receive context goes now, before them.
    deciding->listener->shared_recv.reset();
  }
  for (auto& listener : all.listeners) listener->pep.reset();
  if (m_closed_listeners) m_closed_listeners->release_all();
  for (auto& conn : all.connections) abandon(*conn);
  // No queue is read from here on, so nothing can point into what goes next. Endpoints
  // before shared receive contexts and registrations, those before their domains.
  all.connections.clear();
  m_retired.clear();
  all.listeners.clear();
  m_registry.clear_index();
  m_global_recv.clear();
  m_domain_fds.clear();
  m_domains.clear();
  NETIO3_DEBUG("libfabric: backend shut down");
}

EndPointAddress Backend::open_listen_endpoint(const EndPointAddress& address,
                                              const ConnectionParameters& params) {
  const ApiCall call = open_call(address, params, true);
  check_parameters(params);
  const auto fail = [&](const std::string& why) {
    return FailedOpenListenEndpoint(
        fmt::format("libfabric: cannot listen on {}: {}", address, why));
  };
  Info info = fabric_info(address, true, fail);
  Domain& domain = open_domain(*info, fail);
  // A closed listener may still hold the port: this listen endpoint replaces it.
  if (address.port != 0) m_closed_listeners->release_port(address.port);
  const auto held = m_registry.lock();
  if (address.port != 0) m_registry.check_listen_free(held, address);
  auto listener = std::make_shared<Listener>(next_id(), address, params, &domain);
  try {
    if (params.recv_params.use_shared_receive_buffers) {
      listener->shared_recv = make_shared_recv(domain, params.recv_params);
    }
    fid_pep* pep = nullptr;
    fi_check("fi_passive_ep",
             fi_passive_ep(domain.fabric(), info.get(), &pep, as_context(listener->id)));
    listener->pep.reset(pep);
    fi_check("fi_pep_bind", fi_pep_bind(pep, &domain.eq()->fid, 0));
    fi_check("fi_listen", fi_listen(pep));
    listener->cm_data_size = cm_data_room(&pep->fid).value_or(listener->cm_data_size);
    // A keyed server's accept data carry its proof and identity (admission.hpp).
    const std::size_t accept_size =
        CM_DATA_SIZE + detail::ADMISSION_SHORT_PROOF_SIZE + 1 + m_config.identity.size();
    if (!m_key.empty() && accept_size > listener->cm_data_size) {
      throw std::runtime_error(fmt::format(
          "the identity ({} bytes) does not fit provider '{}''s connection data ({} bytes; the "
          "accept data of a keyed server take {} bytes and the identity)",
          m_config.identity.size(), domain.provider(), listener->cm_data_size,
          accept_size - m_config.identity.size()));
    }
    std::array<std::uint8_t, 128> name{};
    std::size_t len = name.size();
    fi_check("fi_getname", fi_getname(&pep->fid, name.data(), &len));
    const auto bound = detail::to_endpoint_address(name.data(), len);
    if (!bound) throw std::runtime_error("fi_getname returned no IP address");
    listener->address = EndPointAddress{address.address, bound->port};
  } catch (const std::runtime_error& e) {
    throw FailedOpenListenEndpoint(
        fmt::format("libfabric: cannot listen on {}: {}", address, e.what()));
  }
  EndPointAddress actual = listener->address;
  m_registry.check_listen_free(held, actual);
  m_registry.index(listener);
  m_registry.add_listener(held, actual, std::move(listener));
  {
    const std::lock_guard lock{m_domains_mutex};
    if (!domain.first_listener) domain.first_listener = actual;
  }
  NETIO3_DEBUG("libfabric: listening on {} (provider {})", actual, domain.provider());
  return actual;
}

void Backend::open_active_endpoint(const EndPointAddress& address,
                                   const ConnectionParameters& params) {
  const ApiCall call = open_call(address, params, false);
  check_parameters(params);
  const auto fail = [&](const std::string& why) {
    return FailedOpenActiveEndpoint(
        fmt::format("libfabric: cannot connect to {}: {}", address, why));
  };
  Info info = fabric_info(address, false, fail);
  Domain& domain = open_domain(*info, fail);
  const auto held = m_registry.lock();
  m_registry.check_connection_free(held, address);
  std::shared_ptr<Connection> conn;
  try {
    conn = make_connection(address, params, 0, domain, Phase::CONNECTING, global_recv(domain));
    if (!m_key.empty()) conn->admission.emplace(Connection::ClientAdmission{detail::make_nonce()});
    // Held until the endpoint has bound to the port (fabric.hpp).
    const detail::Socket reservation = reserve_source_port(info.get());
    open_endpoint(*conn, info.get());
  } catch (const InvalidConnectionParameters&) {
    throw;
  } catch (const std::runtime_error& e) {
    throw FailedOpenActiveEndpoint(
        fmt::format("libfabric: cannot connect to {}: {}", address, e.what()));
  }
  m_registry.index(conn);
  m_registry.add_connection(held, conn);
  conn->setup_deadline = track_setup(conn);
  const auto data = connect_data(*conn);
  if (const auto room = cm_data_room(&conn->ep->fid); room && data.size() > *room) {
    refuse_later(conn, RefusalCause::SETUP_FAILED,
                 fmt::format("the identity ({} bytes) does not fit provider '{}''s connection "
                             "data ({} bytes; a keyed request takes {} bytes and the identity)",
                             m_config.identity.size(), domain.provider(), *room,
                             data.size() - m_config.identity.size()));
    return;
  }
  const int rc = fi_connect(conn->ep.get(), info->dest_addr, data.data(), data.size());
  if (rc != 0) {
    // Reported like a refusal, from the loop (never from inside this call).
    refuse_later(conn, RefusalCause::UNREACHABLE,
                 fmt::format("fi_connect failed: {}", fi_error(rc)));
    return;
  }
  NETIO3_DEBUG("libfabric: connecting to {} (provider {})", address, domain.provider());
}

NetioStatus Backend::post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer) {
  const iovec iov{buffer->data(), buffer->size()};
  std::array<void*, 1> desc{};
  {
    const std::lock_guard lock{conn->mutex};
    desc[0] = conn->send_desc;
  }
  return post_send(*conn, {}, std::span{&iov, 1}, desc, detail::PendingSend{buffer->id(), buffer},
                   buffer->size());
}

NetioStatus Backend::post_data(const std::shared_ptr<Connection>& conn,
                               std::span<const std::uint8_t> header, std::span<const iovec> iov,
                               Payload payload, detail::PendingSend pending) {
  assert(payload == Payload::REFERENCE);  // NO_COPY_SENDS
  (void)payload;
  void* region_desc = nullptr;
  {
    const std::lock_guard lock{conn->mutex};
    region_desc = conn->region_desc;
  }
  std::size_t size = header.size();
  for (const auto& v : iov) size += v.iov_len;
  std::array<void*, MAX_IOV> desc{};
  std::fill(desc.begin(), desc.end(), region_desc);
  return post_send(*conn, header, iov, std::span{desc}.first(std::min(iov.size(), MAX_IOV)),
                   pending, size);
}

void Backend::check_parameters(const ConnectionParameters& params) {
  if (params.send_zero_copy_params.mr_start != nullptr && params.send_buffered_params.num_buf > 0) {
    throw InvalidConnectionParameters(
        "libfabric: an endpoint sends either buffered (send_buffered_params) or zero-copy "
        "(send_zero_copy_params), not both");
  }
}

Domain& Backend::domain_for(const fi_info& info) {
  const std::lock_guard lock{m_domains_mutex};
  for (const auto& d : m_domains) {
    if (d->serves(info)) return *d;
  }
  auto domain = std::make_unique<Domain>(info);
  Domain* d = domain.get();
  std::weak_ptr<Backend> weak = weak_from_this();
  DomainFds fds;
  // A callback inside a drain may destroy the backend and with it the domain: look at
  // shut_down() before touching the domain again.
  fds.eq = m_loop->add_fd(d->eq_fd(), EPOLLIN, [weak, d](std::uint32_t) {
    auto self = weak.lock();
    if (!self || d->eq_paused) return;
    const std::size_t handled = self->drain_eq(*d);
    if (self->shut_down()) return;
    // A flood fills the table without any event: the provider accepts on its own.
    if (self->pause_if_short_of_descriptors(*d)) return;
    self->on_wait_fd(*d, handled);
  });
  fds.cq = m_loop->add_fd(d->cq_fd(), EPOLLIN, [weak, d](std::uint32_t) {
    auto self = weak.lock();
    if (!self) return;
    const std::size_t handled = self->drain_cq(*d);
    if (!self->shut_down()) self->on_wait_fd(*d, handled);
  });
  // Made now, while descriptors are to be had (a timerfd is one).
  fds.resume = m_loop->create_timer([weak, d] {
    if (auto self = weak.lock(); self && !self->shut_down()) self->resume_eq(*d);
  });
  m_domain_fds.push_back(std::move(fds));
  m_domains.push_back(std::move(domain));
  NETIO3_DEBUG(
      "libfabric: opened provider '{}' fabric '{}' domain '{}' (mr_mode {:#x}, inject {}, "
      "iov_limit {}, tx depth {}, shared rx {})",
      d->provider(), d->info().fabric_attr->name, d->info().domain_attr->name,
      d->info().domain_attr->mr_mode, d->info().tx_attr->inject_size, d->iov_limit(), d->tx_depth(),
      d->has_shared_rx());
  return *d;
}

std::shared_ptr<RecvBuffers> Backend::make_buffers(Domain& domain, std::size_t num_buf,
                                                   std::size_t buf_size, bool shared) const {
  const std::size_t depth = domain.info().rx_attr->size;
  if (!shared && depth > 0 && num_buf > depth) {
    throw InvalidConnectionParameters(fmt::format(
        "libfabric: recv_params.num_buf {} exceeds the receive queue depth {} of provider '{}'",
        num_buf, depth, domain.provider()));
  }
  auto recv = std::make_shared<RecvBuffers>(num_buf, buf_size, safe());
  for (std::size_t i = 0; i < num_buf; ++i) {
    NetworkBuffer* buffer = recv->pool.acquire();
    recv->buffers.push_back(buffer);
    auto& op = recv->ops[i];
    op.kind = Op::Kind::RECV;
    op.recv = recv.get();
    op.buffer = buffer;
  }
  return recv;
}

std::shared_ptr<RecvBuffers> Backend::make_shared_recv(Domain& domain,
                                                       const RecvParameters& params) {
  if (!domain.has_shared_rx()) {
    NETIO3_INFO(
        "libfabric: provider '{}' has no shared receive context; every endpoint gets "
        "its own {} receive buffers of {} bytes instead",
        domain.provider(), params.num_buf, params.buf_size);
    return nullptr;
  }
  auto recv = make_buffers(domain, params.num_buf, params.buf_size, true);
  recv->desc = domain.shared_registration(recv->pool.region());
  fi_rx_attr attr = *domain.info().rx_attr;
  attr.size = std::max<std::size_t>(attr.size, params.num_buf);
  fid_ep* srx = nullptr;
  fi_check("fi_srx_context", fi_srx_context(domain.domain(), &attr, &srx, nullptr));
  recv->srx.reset(srx);
  for (auto& op : recv->ops) post_receive(op, srx);
  return recv;
}

std::shared_ptr<RecvBuffers> Backend::global_recv(Domain& domain) {
  const auto& rx = m_config.shared_receive_buffers;
  if (!rx.use_shared_receive_buffers) return nullptr;
  const std::lock_guard lock{m_domains_mutex};
  auto& recv = m_global_recv[&domain];
  if (!recv) {
    recv = make_shared_recv(domain, RecvParameters{.buf_size = rx.buf_size, .num_buf = rx.num_buf});
  }
  return recv;
}

std::uint64_t Backend::new_token(const Domain& domain) {
  const std::size_t bytes = domain.cq_data_size();
  // Below the tag bit where tokens travel (at least 4 bytes of CQ data), else any 63 bits.
  const std::uint64_t mask =
      (bytes >= sizeof(std::uint32_t) ? cq_tag_bit(bytes) : cq_tag_bit(8)) - 1;
  while (true) {
    const std::uint64_t token = detail::random_u64() & mask;
    if (token != 0 && !m_registry.by_id(token)) return token;
  }
}

std::shared_ptr<Connection> Backend::make_connection(const EndPointAddress& remote,
                                                     const ConnectionParameters& params,
                                                     std::uint64_t listener_id, Domain& domain,
                                                     Phase initial,
                                                     std::shared_ptr<RecvBuffers> shared) {
  auto conn = std::make_shared<Connection>(new_token(domain), remote, params, listener_id, &domain,
                                           safe(), initial);
  // Receive buffers: the shared ones if there are any; else the endpoint's own, as asked
  // by recv_params or, where shared buffers are configured but the provider has no shared
  // receive context, as configured for the shared ones.
  RecvParameters own = params.recv_params;
  const auto& configured = m_config.shared_receive_buffers;
  if (own.num_buf == 0 && configured.use_shared_receive_buffers) {
    own = RecvParameters{.buf_size = configured.buf_size, .num_buf = configured.num_buf};
  }
  // A side whose sends are acknowledged receives the acknowledgements (fabric.hpp).
  if (own.num_buf == 0 && !shared && params.delivery.acknowledged) {
    own = ACK_RECEIVE_BUFFERS;
    conn->recv_for_acks_only = true;
  }
  if (shared) {
    conn->recv = std::move(shared);
  } else if (own.num_buf > 0) {
    conn->recv = make_buffers(domain, own.num_buf, own.buf_size, false);
    conn->recv->mr = domain.register_memory(conn->recv->pool.region());
    conn->recv->desc = fi_mr_desc(conn->recv->mr.get());
    for (auto& op : conn->recv->ops) op.conn = conn.get();
  }
  const auto& zc = params.send_zero_copy_params;
  if (zc.mr_start != nullptr) {
    conn->region = {zc.mr_start, zc.buf_size};
    conn->region_mr = domain.register_memory(conn->region);
    conn->region_desc = fi_mr_desc(conn->region_mr.get());
  } else {
    detail::attach_send_pool(*conn, m_shared_send_pool.get(), 0, safe());
    if (conn->own_send_pool) {
      conn->send_mr = domain.register_memory(conn->own_send_pool->region());
      conn->send_desc = fi_mr_desc(conn->send_mr.get());
    } else if (conn->send_pool != nullptr) {
      conn->send_desc = domain.shared_registration(conn->send_pool.load()->region());
    }
  }
  // Send contexts (and, for zero-copy, registered header slots) only for an endpoint that
  // can send: a receive-only connection costs no memory per transmit-queue entry.
  const bool zero_copy = zc.mr_start != nullptr;
  const bool can_send = zero_copy || conn->send_pool != nullptr;
  // One entry of the transmit queue is left for heartbeats (send_heartbeat).
  const std::size_t depth =
      can_send ? std::clamp<std::size_t>(domain.tx_depth(), 2, MAX_SEND_DEPTH + 1) - 1 : 0;
  if (zero_copy) {
    conn->header_slots.resize(depth);
    conn->header_mr = domain.register_memory(
        {reinterpret_cast<std::uint8_t*>(conn->header_slots.data()),  // NOLINT
         conn->header_slots.size() * MAX_HEADER_SIZE});
    conn->header_desc = fi_mr_desc(conn->header_mr.get());
  }
  conn->send_ops.resize(depth);
  conn->free_send_ops.reserve(depth);
  for (std::size_t i = depth; i-- > 0;) {
    auto& op = conn->send_ops[i];
    op.kind = Op::Kind::SEND;
    op.conn = conn.get();
    op.slot = static_cast<std::uint32_t>(i);
    conn->free_send_ops.push_back(static_cast<std::uint32_t>(i));
  }
  return conn;
}

void Backend::open_endpoint(Connection& conn, fi_info* info) const {
  Domain& domain = *conn.domain;
  fid_ep* ep = nullptr;
  fi_check("fi_endpoint", fi_endpoint(domain.domain(), info, &ep, as_context(conn.id)));
  conn.ep.reset(ep);
  fi_check("fi_ep_bind(EQ)", fi_ep_bind(ep, &domain.eq()->fid, 0));
  fi_check("fi_ep_bind(CQ)", fi_ep_bind(ep, &domain.cq()->fid, FI_TRANSMIT | FI_RECV));
  if (conn.recv && conn.recv->srx)
    fi_check("fi_ep_bind(SRX)", fi_ep_bind(ep, &conn.recv->srx->fid, 0));
  fi_check("fi_enable", fi_enable(ep));
  if (conn.recv && !conn.recv->srx) {
    for (auto& op : conn.recv->ops) post_receive(op, ep);
  }
}

EndpointCapabilities Backend::capabilities(const Connection& conn) {
  return EndpointCapabilities{.send_buffered = conn.send_pool != nullptr,
                              .send_copy = false,
                              .send_zero_copy = conn.region_mr != nullptr,
                              .receive = conn.recv != nullptr && !conn.recv_for_acks_only};
}

NetioStatus Backend::post_send(Connection& conn, std::span<const std::uint8_t> header,
                               std::span<const iovec> payload, std::span<void* const> payload_desc,
                               detail::PendingSend pending, std::size_t size) {
  {
    const std::lock_guard lock{conn.mutex};
    if (conn.close_requested.load(std::memory_order_relaxed) || conn.ending()) {
      return detail::send_failed(
          SendFailureCause::CLOSING,
          fmt::format("libfabric: send to {}: the connection is closing", conn.remote), false);
    }
    if (conn.phase != Phase::OPEN) return NetioStatus::NO_RESOURCES;  // still connecting
    if (size > conn.peer_recv_size) {
      return detail::send_failed(SendFailureCause::TOO_LARGE,
                                 fmt::format("libfabric: send to {}: a message of {} bytes "
                                             "exceeds the peer's receive buffers of {} bytes",
                                             conn.remote, size, conn.peer_recv_size));
    }
    const std::size_t count = payload.size() + (header.empty() ? 0 : 1);
    if (count > std::min(conn.domain->iov_limit(), MAX_IOV) ||
        payload.size() > payload_desc.size()) {
      return detail::send_failed(
          SendFailureCause::INVALID,
          fmt::format("libfabric: send to {}: {} pieces exceed the provider's iov_limit {}",
                      conn.remote, count, conn.domain->iov_limit()));
    }
    if (conn.unsent_bytes >= m_config.limits.max_unsent_bytes || conn.free_send_ops.empty()) {
      return NetioStatus::NO_RESOURCES;
    }
    const std::uint32_t slot = conn.free_send_ops.back();
    Op& op = conn.send_ops[slot];
    std::array<iovec, MAX_IOV> iov{};
    std::array<void*, MAX_IOV> desc{};
    std::size_t n = 0;
    if (!header.empty()) {
      auto& room = conn.header_slots[slot];
      std::copy(header.begin(), header.end(), room.begin());
      iov[n] = iovec{room.data(), header.size()};
      desc[n++] = conn.header_desc;
    }
    for (std::size_t i = 0; i < payload.size(); ++i, ++n) {
      iov.at(n) = payload[i];
      desc.at(n) = payload_desc[i];
    }
    op.ticket = conn.ledger.add(pending);
    op.bytes = size;
    op.buffer = pending.buffer;
    ssize_t rc = 0;
    if (conn.data_tag == 0) {
      rc = n == 1 ? fi_send(conn.ep.get(), iov[0].iov_base, iov[0].iov_len, desc[0], 0, &op)
                  : fi_sendv(conn.ep.get(), iov.data(), desc.data(), n, 0, &op);
    } else {
      // The peer receives through a shared receive context: the tag names this connection.
      const fi_msg msg{.msg_iov = iov.data(),
                       .desc = desc.data(),
                       .iov_count = n,
                       .addr = 0,
                       .context = &op,
                       .data = conn.data_tag};
      rc = fi_sendmsg(conn.ep.get(), &msg, FI_REMOTE_CQ_DATA);
    }
    if (rc != 0) {
      conn.ledger.retract(op.ticket);
      if (rc == -FI_EAGAIN) return NetioStatus::NO_RESOURCES;
      return detail::send_failed(
          SendFailureCause::TRANSPORT,
          fmt::format("libfabric: send to {} failed: {}", conn.remote, fi_error(rc)));
    }
    conn.free_send_ops.pop_back();
    conn.unsent_bytes += size;
  }
  NETIO3_TRACE("libfabric: send to {} key={} size={}", conn.remote, pending.key, size);
  // Manual progress: the loop must read the queue for the transfer to move on.
  if (!m_loop->in_loop_thread() && !m_kick_pending.exchange(true)) m_kick.fire();
  return NetioStatus::OK;
}

std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                               std::shared_ptr<BaseEventLoop> loop) {
  return std::make_unique<detail::BackendFacade<Backend>>(std::move(config), std::move(loop));
}

}  // namespace netio3::libfabric
