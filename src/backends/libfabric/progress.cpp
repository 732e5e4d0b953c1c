// libfabric backend, the loop thread: reading event and completion queues, connection
// management events, and a connection's close.

#include "backends/libfabric/libfabric_backend_impl.hpp"

namespace netio3::libfabric {

namespace {

// One event queue entry, with room for connection data.
constexpr std::size_t EQ_ENTRY_SIZE = sizeof(fi_eq_cm_entry) + 256;

// Reads `domain`'s event queue until it is empty, `max` entries were read, or a handler
// returns false (go no further): on_event(event, entry, data) for an event, on_error(err)
// for an error entry. Returns how many entries it read.
template <typename OnEvent, typename OnError>
std::size_t read_events(Domain& domain, int max, const OnEvent& on_event, const OnError& on_error) {
  alignas(fi_eq_cm_entry) std::array<std::uint8_t, EQ_ENTRY_SIZE> buffer{};
  std::size_t read = 0;
  for (int i = 0; i < max; ++i) {
    std::uint32_t event = 0;
    const ssize_t rc = fi_eq_read(domain.eq(), &event, buffer.data(), buffer.size(), 0);
    if (rc == -FI_EAGAIN) break;
    ++read;
    if (rc == -FI_EAVAIL) {
      fi_eq_err_entry err{};
      if (fi_eq_readerr(domain.eq(), &err, 0) < 0) break;
      if (!on_error(err)) break;
      continue;
    }
    if (rc < 0) {
      NETIO3_ERROR("libfabric: fi_eq_read failed: {}", fi_error(rc));
      break;
    }
    const auto* entry = reinterpret_cast<const fi_eq_cm_entry*>(buffer.data());  // NOLINT
    const std::size_t data_len = static_cast<std::size_t>(rc) > sizeof(fi_eq_cm_entry)
                                     ? static_cast<std::size_t>(rc) - sizeof(fi_eq_cm_entry)
                                     : 0;
    if (!on_event(event, *entry, std::span<const std::uint8_t>{entry->data, data_len})) break;
  }
  return read;
}

}  // namespace

void Backend::on_kick() {
  m_kick_pending.store(false);
  drain_all();
}

const std::vector<Domain*>& Backend::loop_domains() {
  assert_loop_thread();
  const std::lock_guard lock{m_domains_mutex};
  if (m_loop_domains.size() != m_domains.size()) {
    m_loop_domains.clear();
    for (const auto& d : m_domains) m_loop_domains.push_back(d.get());
  }
  return m_loop_domains;
}

void Backend::drain_all() {
  const auto& domains = loop_domains();
  // By index: draining may open a domain (a connection request), which grows the vector.
  for (std::size_t i = 0; i < domains.size(); ++i) {  // NOLINT(modernize-loop-convert)
    Domain* d = domains[i];
    if (shut_down()) return;
    if (!d->eq_paused) drain_eq(*d);
    if (shut_down()) return;
    drain_cq(*d);
  }
}

bool Backend::may_sleep() {
  assert_loop_thread();
  if (shut_down()) return true;
  const auto& domains = loop_domains();
  bool sleep = true;
  if (m_loop->polling()) {
    // Busy-polling: the loop will not sleep this round; read the queues (which also
    // drives the provider's progress) instead of arming them.
    // NOLINTNEXTLINE(modernize-loop-convert): by index, see drain_all
    for (std::size_t i = 0; i < domains.size(); ++i) {
      Domain* d = domains[i];
      if (!d->eq_paused && drain_eq(*d) > 0) sleep = false;
      if (shut_down()) return true;
      if (drain_cq(*d) > 0) sleep = false;
      if (shut_down()) return true;
    }
    return sleep;
  }
  // NOLINTNEXTLINE(modernize-loop-convert): by index, see drain_all
  for (std::size_t i = 0; i < domains.size(); ++i) {
    Domain* d = domains[i];
    // A paused event queue is not asked: its listening socket stays readable.
    if (!d->peer_shutdowns.empty()) {  // closes wait for a drain to the end of the queue
      sleep = false;
      (void)drain_cq(*d);
      if (shut_down()) return true;
      continue;
    }
    std::array<fid*, 2> fids{&d->cq()->fid, &d->eq()->fid};
    const int count = d->eq_paused ? 1 : 2;
    if (fi_trywait(d->fabric(), fids.data(), count) != FI_SUCCESS) {
      sleep = false;
      const std::size_t events = d->eq_paused ? 0 : drain_eq(*d);
      if (shut_down()) return true;
      const std::size_t completions = drain_cq(*d);
      if (shut_down()) return true;
      if (events + completions == 0 && !d->eq_paused) pause_if_short_of_descriptors(*d);
    }
  }
  return sleep;
}

bool Backend::pause_if_short_of_descriptors(Domain& domain) {
  if (domain.eq_paused) return false;
  const std::string shortage = detail::descriptor_shortage();
  if (shortage.empty()) return false;
  if (!domain.accept_pauses) {
    const std::lock_guard lock{m_domains_mutex};
    domain.accept_pauses.emplace(
        NAME, domain.first_listener.value_or(EndPointAddress{std::string{domain.provider()}, 0}));
  }
  domain.accept_pauses->paused(shortage);
  domain.eq_paused = true;
  domain.spurious_wakeups = 0;
  const std::lock_guard lock{m_domains_mutex};
  DomainFds& fds = fds_of(domain);
  fds.eq.modify(0);
  fds.resume.start_once(detail::AcceptPauses::BACKOFF);
  return true;
}

void Backend::resume_eq(Domain& domain) {
  domain.eq_paused = false;
  const std::lock_guard lock{m_domains_mutex};
  fds_of(domain).eq.modify(EPOLLIN);
}

Backend::DomainFds& Backend::fds_of(const Domain& domain) {
  const auto it = std::find_if(m_domains.begin(), m_domains.end(),
                               [&](const auto& d) { return d.get() == &domain; });
  assert(it != m_domains.end());
  return m_domain_fds[static_cast<std::size_t>(it - m_domains.begin())];
}

void Backend::on_wait_fd(Domain& domain, std::size_t handled) {
  if (handled > 0) {
    domain.spurious_wakeups = 0;
    return;
  }
  if (++domain.spurious_wakeups == SPURIOUS_WAKEUPS_WARN) {
    NETIO3_WARN(
        "libfabric: provider '{}' woke the event loop {} times in a row with nothing to "
        "report: its wait objects cannot be slept on and the loop is busy. Use the tcp "
        "or verbs provider (FI_PROVIDER)",
        domain.provider(), SPURIOUS_WAKEUPS_WARN);
  }
}

void Backend::refuse_queued_requests(Domain& domain) noexcept {
  (void)read_events(
      domain, 100'000,
      [&](std::uint32_t event, const fi_eq_cm_entry& entry, std::span<const std::uint8_t>) {
        if (event == FI_CONNREQ) {
          const Info info{entry.info};
          refuse_request(domain, m_registry.listener_by_id(id_of(entry.fid)).get(), info.get());
        }
        return true;
      },
      [](const fi_eq_err_entry&) { return true; });
}

void Backend::refuse_request(Domain& domain, const Listener* listener, fi_info* request) noexcept {
  const std::lock_guard lock{m_pep_mutex};
  if (listener != nullptr && listener->pep) {
    fi_reject(listener->pep.get(), request->handle, nullptr, 0);
  } else {
    discard_request(domain, request);
  }
}

void Backend::reject_request(const Listener& listener, fi_info* request, std::uint16_t flags,
                             std::span<const std::uint8_t> tail) noexcept {
  const std::size_t room =
      listener.cm_data_size > CM_DATA_SIZE ? listener.cm_data_size - CM_DATA_SIZE : 0;
  std::vector<std::uint8_t> data;
  try {
    data = encode_cm(CmData{.recv_buf_size = 0, .flags = flags},
                     tail.first(std::min(room, tail.size())));
  } catch (const std::bad_alloc&) {
    data.clear();  // rejected without data, below
  }
  const std::lock_guard lock{m_pep_mutex};
  if (!listener.pep) {  // released meanwhile (its port was taken by a new listen endpoint)
    discard_request(*listener.domain, request);
    return;
  }
  const int rc = fi_reject(listener.pep.get(), request->handle, data.data(), data.size());
  // The provider frees the request whether or not the peer hears of it, except where it
  // refuses the data (a size it does not carry): then without data.
  if (rc != 0 && !data.empty()) {
    NETIO3_DEBUG("libfabric: fi_reject with {} bytes of data failed: {}", data.size(),
                 fi_error(rc));
    fi_reject(listener.pep.get(), request->handle, nullptr, 0);
  }
}

void Backend::discard_request(Domain& domain, fi_info* request) noexcept {
  // A request's handle has no operations of its own (fi_close on it would crash the tcp and
  // verbs providers): an endpoint takes it over, and closing that frees it.
  fid_ep* ep = nullptr;
  if (fi_endpoint(domain.domain(), request, &ep, nullptr) == 0) {
    fi_close(&ep->fid);
  } else {
    NETIO3_DEBUG(
        "libfabric: a connection request of a released listen endpoint is left to "
        "the provider");
  }
}

std::size_t Backend::drain_eq(Domain& domain) {
  assert_loop_thread();
  if (shut_down()) return 0;
  return read_events(
      domain, DRAIN_ROUNDS * 4,
      [&](std::uint32_t event, const fi_eq_cm_entry& entry, std::span<const std::uint8_t> data) {
        on_cm_event(domain, event, entry, data);
        return !shut_down();
      },
      [&](const fi_eq_err_entry& err) {
        on_eq_error(domain, err);
        return !shut_down();
      });
}

std::size_t Backend::drain_cq(Domain& domain) {
  assert_loop_thread();
  std::array<fi_cq_data_entry, CQ_BATCH> entries{};
  std::size_t handled = 0;
  // The queue was read empty: what a peer's shutdown and a retired endpoint wait for.
  const auto read_empty = [&] {
    ++domain.drains;
    close_shut_down_peers(domain);
    if (shut_down()) return;
    release_retired(domain);
  };
  for (int round = 0; round < DRAIN_ROUNDS; ++round) {
    if (shut_down()) return handled;
    const ssize_t n = fi_cq_read(domain.cq(), entries.data(), entries.size());
    // Only -FI_EAGAIN says the queue is empty: a read of fewer entries than asked for stops at
    // an error entry too (a cancelled receive of a shut-down endpoint), with other
    // connections' messages behind it (closing at such a read lost them in the fan-in test).
    if (n == -FI_EAGAIN) {
      read_empty();
      return handled;
    }
    if (n == -FI_EAVAIL) {
      ++handled;
      fi_cq_err_entry err{};
      if (fi_cq_readerr(domain.cq(), &err, 0) < 0) return handled;
      on_completion_error(domain, err);
      continue;
    }
    if (n < 0) {
      NETIO3_ERROR("libfabric: fi_cq_read failed: {}", fi_error(n));
      return handled;
    }
    handled += static_cast<std::size_t>(n);
    for (ssize_t i = 0; i < n; ++i) {
      on_completion(domain, entries.at(static_cast<std::size_t>(i)));
      if (shut_down()) return handled;
    }
  }
  return handled;
}

void Backend::close_shut_down_peers(Domain& domain) {
  if (domain.peer_shutdowns.empty()) return;
  const std::vector<std::uint64_t> ids = std::exchange(domain.peer_shutdowns, {});
  for (const std::uint64_t id : ids) {
    if (auto conn = m_registry.by_id(id)) {
      // Everything the peer sent before its end was read: a goodbye among it, if it sent one.
      if (conn->peer_says_goodbye && !conn->goodbye_received) {
        close(conn, detail::ENDED_WITHOUT_GOODBYE, CloseCause::ERROR);
      } else {
        close(conn, "peer closed the connection", CloseCause::PEER);
      }
    }
    if (shut_down()) return;
  }
}

void Backend::on_completion(const Domain& domain, const fi_cq_data_entry& entry) {
  auto* op = static_cast<Op*>(entry.op_context);
  if (op == nullptr) return;
  if (op->kind == Op::Kind::RECV) {
    op->recv->posted.fetch_sub(1, std::memory_order_relaxed);
    // Remote CQ data: a heartbeat (the token), or a tagged message (the token and the tag
    // bit: a shared receive context's, CM_TAG_DATA).
    if ((entry.flags & FI_REMOTE_CQ_DATA) != 0) [[unlikely]] {
      const std::uint64_t tag_bit = cq_tag_bit(domain.cq_data_size());
      if ((entry.data & tag_bit) != 0) {
        on_received(*op, entry.len, entry.data & ~tag_bit);
      } else {
        on_heartbeat(*op, entry.data, entry.len == GOODBYE_SIZE);
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

void Backend::on_cm_event(Domain& domain, std::uint32_t event, const fi_eq_cm_entry& entry,
                          std::span<const std::uint8_t> data) {
  switch (event) {
    case FI_CONNREQ:
      if (domain.accept_pauses) domain.accept_pauses->accepted();
      on_connection_request(domain, entry, data);
      break;
    case FI_CONNECTED:
      if (auto conn = m_registry.by_id(id_of(entry.fid))) on_connected(conn, data);
      break;
    case FI_SHUTDOWN: {
      // The provider reports what it read before the peer's end of stream on the
      // completion queue and the end itself on the event queue, and the loop may read the
      // event queue first: deliver those messages before the close discards the receives.
      // The id first: the drain may close the connection (a send failed) and free its
      // endpoint, which entry.fid points to.
      // A bounded drain may stop with the connection's last messages still queued (several
      // peers streaming at once): the close waits for a drain that read the queue empty.
      domain.peer_shutdowns.push_back(id_of(entry.fid));
      (void)drain_cq(domain);
      break;
    }
    default:
      NETIO3_DEBUG("libfabric: ignoring event queue event {}", event);
      break;
  }
}

void Backend::on_eq_error(Domain& domain, const fi_eq_err_entry& err) {
  std::string why = fi_strerror(err.err);
  // The provider's own words, where it has some (for prov_errno 0 they read "Success").
  if (err.prov_errno != 0) {
    std::array<char, 256> detail_text{};
    const char* detail = fi_eq_strerror(domain.eq(), err.prov_errno, err.err_data,
                                        detail_text.data(), detail_text.size());
    if (detail != nullptr && *detail != '\0') why = fmt::format("{}: {}", why, detail);
  }
  auto refusal = RefusalCause::SETUP_FAILED;
  // What the reject data ask of the connection, once it is known: a refusal, another source
  // port, or the second request of the partition key's challenge.
  enum class Then : std::uint8_t { REFUSE, OTHER_SOURCE_PORT, ANSWER_CHALLENGE };
  Then then = Then::REFUSE;
  std::optional<Challenge> challenge;
  if (err.err == FI_ECONNREFUSED) {
    // A netio3 listener that says no sends its connection data with the refusal; a closed
    // port (or a closed listener) sends none.
    std::string ignored;
    const std::span<const std::uint8_t> reject_data =
        err.err_data != nullptr
            ? std::span{static_cast<const std::uint8_t*>(err.err_data), err.err_data_size}
            : std::span<const std::uint8_t>{};
    const auto data = reject_data.size() >= CM_DATA_MIN_SIZE ? decode_cm_data(reject_data, ignored)
                                                             : std::nullopt;
    if (!data) {
      refusal = RefusalCause::UNREACHABLE;
      why += " (nothing listens there, or its listen endpoint was closed)";
    } else if ((data->flags & CM_REFUSED_ADDRESS_IN_USE) != 0) {
      then = Then::OTHER_SOURCE_PORT;
      refusal = RefusalCause::REJECTED;
      why = "refused by the peer: it has a connection from this source address and port already";
    } else if ((data->flags & CM_NOT_ADMITTED) != 0) {
      refusal = RefusalCause::NOT_ADMITTED;
      const std::string text = detail::decode_refusal(cm_tail(reject_data));
      why = text == detail::PEER_HOLDS_NO_KEY || text == detail::PEER_REQUIRES_KEY
                ? text
                : fmt::format("refused by the server: {}", text);
    } else if ((data->flags & CM_CHALLENGE) != 0) {
      then = Then::ANSWER_CHALLENGE;
      challenge = decode_challenge(cm_tail(reject_data));
    } else {
      refusal = RefusalCause::REJECTED;
      why = "refused by the peer (its log says why)";
    }
  } else if (err.err == FI_ETIMEDOUT) {
    refusal = RefusalCause::TIMED_OUT;
  } else if (err.err == FI_EHOSTUNREACH || err.err == FI_ENETUNREACH) {
    refusal = RefusalCause::UNREACHABLE;
  }
  if (auto conn = m_registry.by_id(id_of(err.fid))) {
    if (then == Then::OTHER_SOURCE_PORT && conn->phase == Phase::CONNECTING &&
        reconnect_from_new_source_port(conn)) {
      return;
    }
    if (then == Then::ANSWER_CHALLENGE) {
      (void)answer_challenge(conn, challenge);
      return;
    }
    if (conn->setting_up() && refusal == RefusalCause::SETUP_FAILED) {
      why += " (the connection broke off during the provider's set-up)";
    }
    // As the other backends' clients do: a refusal by admission is worth a line of its own.
    if (refusal == RefusalCause::NOT_ADMITTED) {
      NETIO3_WARN("libfabric: connection to {} not admitted: {}", conn->remote, why);
    }
    refuse(conn, refusal, why);
    return;
  }
  NETIO3_DEBUG("libfabric: event queue error for no known endpoint: {}", why);
}

bool Backend::reconnect_from_new_source_port(const std::shared_ptr<Connection>& old) {
  if (!detail::retry_from_new_source_port(*old, NAME)) return false;
  // A keyed client starts its admission over: the server took the challenge with the second
  // request it refused.
  if (old->admission) *old->admission = Connection::ClientAdmission{detail::make_nonce()};
  return connect_again(old);
}

bool Backend::connect_again(const std::shared_ptr<Connection>& old) {
  const auto fail = [](const std::string& why) { return std::runtime_error(why); };
  std::shared_ptr<Connection> conn;
  Info info;
  try {
    info = fabric_info(old->remote, false, fail);
    Domain& domain = open_domain(*info, fail);
    conn = make_connection(old->remote, old->params, 0, domain, Phase::CONNECTING,
                           global_recv(domain));
    const detail::Socket reservation = reserve_source_port(info.get());
    open_endpoint(*conn, info.get());
  } catch (const std::exception& e) {
    NETIO3_WARN("libfabric: connecting again to {}: {}", old->remote, e.what());
    if (conn) retire_unregistered(conn);
    return false;
  }
  conn->source_port_retries = old->source_port_retries;
  conn->admission = old->admission;
  // Buffers the application took from the old endpoint's own pool stay valid: the new
  // endpoint takes the pool over, with its registration.
  if (conn->domain == old->domain) {
    const std::lock_guard old_lock{old->mutex};
    const std::lock_guard lock{conn->mutex};
    std::swap(old->own_send_pool, conn->own_send_pool);
    std::swap(old->send_mr, conn->send_mr);
    std::swap(old->send_desc, conn->send_desc);
    if (conn->own_send_pool) conn->send_pool = conn->own_send_pool.get();
    if (old->own_send_pool) old->send_pool = old->own_send_pool.get();
  }
  m_registry.index(conn);
  bool replaced = false;
  {
    const auto held = m_registry.lock();
    replaced = m_registry.replace_connection(held, old, conn);
  }
  if (!replaced) {  // closed by the application meanwhile: that close reports it
    m_registry.forget(conn->id);
    retire_unregistered(conn);
    return false;
  }
  conn->setup_deadline = old->setup_deadline;
  track_setup(conn, conn->setup_deadline);
  close(old, "superseded", CloseCause::ERROR, false);
  const auto data = connect_data(*conn);
  const int rc = fi_connect(conn->ep.get(), info->dest_addr, data.data(), data.size());
  if (rc != 0) {
    // Reported from the loop, after the event being handled.
    refuse_later(conn, RefusalCause::UNREACHABLE,
                 fmt::format("fi_connect failed: {}", fi_error(rc)));
  }
  return true;
}

void Backend::retire(const std::shared_ptr<Connection>& conn) {
  conn->ep.reset();
  m_retired.push_back(Retired{conn->domain, conn->domain->drains, conn});
}

void Backend::retire_unregistered(const std::shared_ptr<Connection>& conn) {
  {
    const std::lock_guard lock{conn->mutex};
    conn->phase = Phase::CLOSED;
  }
  retire(conn);
}

void Backend::on_connection_request(Domain& domain, const fi_eq_cm_entry& entry,
                                    std::span<const std::uint8_t> data) {
  Info info{entry.info};  // ours to free
  const auto listener = m_registry.listener_by_id(id_of(entry.fid));
  // A request for a closed listener is refused at once (the peer does not wait for its
  // set-up to time out, and the provider frees the request's socket).
  const auto refuse_closed = [&] {
    refuse_request(domain, listener.get(), info.get());
    NETIO3_DEBUG("libfabric: refused a connection request on a closed listen endpoint");
  };
  if (!listener || listener->closed.load()) {
    refuse_closed();
    return;
  }
  const auto reject = [&](std::string_view why, std::uint16_t flags = 0) {
    NETIO3_WARN("libfabric: refusing a connection on {}: {}", listener->address, why);
    reject_request(*listener, info.get(), flags, {});
  };
  std::string error;
  const auto peer = decode_cm_data(data, error);
  if (!peer) {
    reject(error);
    return;
  }
  const auto remote = detail::to_endpoint_address(info->dest_addr, info->dest_addrlen);
  if (!remote) {
    reject("the request carries no IP address");
    return;
  }
  // Admission, before the connection exists: no endpoint, no buffer for a refused peer.
  std::vector<std::uint8_t> accept_tail;
  const bool gated = !m_key.empty() || m_config.on_accept_cb || (peer->flags & CM_KEYED) != 0;
  if (gated && !admit_request(listener, info.get(), *peer, cm_tail(data), *remote, accept_tail)) {
    return;
  }
  std::shared_ptr<Connection> conn;
  {
    const auto held = m_registry.lock();
    // Closed meanwhile (also inside the accept hook; a new listener may have its port).
    if (!m_registry.has_listener(held, listener->address) || listener->closed.load()) {
      refuse_closed();
      return;
    }
    if (m_registry.find(held, *remote)) {
      // A source-port collision (docs/semantics.md): the flag tells a netio3 client to
      // connect from another port.
      reject(fmt::format("a connection from {} exists (a source-port collision: the client "
                         "should connect from another port)",
                         *remote),
             CM_REFUSED_ADDRESS_IN_USE);
      return;
    }
    try {
      conn = make_connection(*remote, listener->params, listener->id, domain, Phase::HANDSHAKE,
                             listener->shared_recv ? listener->shared_recv : global_recv(domain));
      take_peer_cm_data(*conn, *peer);
      open_endpoint(*conn, info.get());
    } catch (const std::exception& e) {
      reject(e.what());
      return;
    }
    m_registry.index(conn);
    m_registry.add_connection(held, conn);
  }
  track_setup(conn);
  CmData own = own_cm_data(*conn);
  if (!m_key.empty()) own.flags |= CM_KEYED;  // the server's proof follows
  const auto reply = encode_cm(own, accept_tail);
  const int rc = fi_accept(conn->ep.get(), reply.data(), reply.size());
  if (rc != 0) {
    close(conn, fmt::format("fi_accept failed: {}", fi_error(rc)), CloseCause::ERROR);
    return;
  }
  NETIO3_DEBUG("libfabric: accepting connection from {} on {}", *remote, listener->address);
}

void Backend::on_connected(const std::shared_ptr<Connection>& conn,
                           std::span<const std::uint8_t> data) {
  if (conn->phase == Phase::CONNECTING) {
    std::string error;
    const auto peer = decode_cm_data(data, error);
    if (!peer) {
      NETIO3_WARN("libfabric: connection with {}: {}", conn->remote, error);
      close(conn, error, CloseCause::ERROR);
      return;
    }
    if (conn->admission && !server_proved(conn, *peer, cm_tail(data))) return;
    take_peer_cm_data(*conn, *peer);
  }
  if (conn->setting_up()) (void)established(conn, capabilities(*conn));
}

// ---- admission ------------------------------------------------------------------------

bool Backend::admit_request(const std::shared_ptr<Listener>& listener, fi_info* request,
                            const CmData& peer, std::span<const std::uint8_t> tail,
                            const EndPointAddress& remote, std::vector<std::uint8_t>& accept_tail) {
  const auto refuse_it = [&](std::string_view reason, std::string_view for_client = {}) {
    return not_admitted(*listener, request, remote, reason,
                        for_client.empty() ? reason : for_client);
  };
  const bool keyed_peer = (peer.flags & CM_KEYED) != 0;
  if (m_key.empty()) {
    if (keyed_peer) {
      // The client is told what its own side would have found: the same words on every
      // backend (asyncmsg and UCX find it in the greetings).
      return refuse_it(detail::PEER_REQUIRES_KEY, detail::PEER_HOLDS_NO_KEY);
    }
    return decide(listener, request, remote, {}, false);
  }
  if (!keyed_peer) {
    return refuse_it(detail::PEER_HOLDS_NO_KEY, detail::PEER_REQUIRES_KEY);
  }
  const auto now = ChallengeTable::Clock::now();
  if ((peer.flags & CM_PROOF) == 0) {
    // The first request: a challenge goes back with the rejection.
    auto keyed = decode_keyed_request(tail);
    if (!keyed) {
      return refuse_it(
          fmt::format("a keyed request whose {} bytes of admission data are no nonce and identity",
                      tail.size()));
    }
    const auto challenge = m_challenges.issue(listener->id, remote.address, std::move(*keyed),
                                              m_config.limits.connect_timeout, now);
    reject_request(*listener, request, CM_CHALLENGE, encode(challenge));
    NETIO3_DEBUG("libfabric: sent a challenge to {} on {}", remote, listener->address);
    return false;
  }
  const auto answer = decode_proof_request(tail);
  if (!answer) {
    return refuse_it(
        fmt::format("an answer to a challenge of {} bytes (24 expected)", tail.size()));
  }
  const auto entry = m_challenges.take(answer->id, remote.address, now);
  if (!entry || entry->listener != listener->id) {
    return refuse_it(
        "the peer answered no pending challenge of its address (a replayed set-up, or an "
        "answer later than limits.connect_timeout)");
  }
  if (!m_key.verify(ADMISSION_PROTOCOL, detail::AdmissionRole::CLIENT, entry->server, entry->client,
                    entry->identity, answer->proof)) {
    return refuse_it(
        "the peer failed to prove the partition key (another key, or a replayed set-up)");
  }
  if (!decide(listener, request, remote, entry->identity, true)) return false;
  const auto proof = m_key.prove(ADMISSION_PROTOCOL, detail::AdmissionRole::SERVER, entry->client,
                                 entry->server, m_config.identity);
  accept_tail = encode(ServerProof{short_proof(proof), m_config.identity});
  return true;
}

bool Backend::decide(const std::shared_ptr<Listener>& listener, fi_info* request,
                     const EndPointAddress& remote, std::string identity, bool key_proven) {
  if (!m_config.on_accept_cb) return true;
  const PeerInfo peer{.remote = remote,
                      .listener = listener->address,
                      .identity = std::move(identity),
                      .key_proven = key_proven};
  {
    const std::lock_guard lock{m_pep_mutex};
    m_deciding = Deciding{listener, request};
  }
  const AcceptDecision decision = detail::run_accept_hook(m_config.on_accept_cb, peer, NAME);
  if (shut_down()) return false;  // the shutdown refused the request
  bool answered = false;
  {
    const std::lock_guard lock{m_pep_mutex};
    answered = m_deciding && m_deciding->answered;
    m_deciding.reset();
  }
  if (answered) {
    NETIO3_DEBUG("libfabric: the listen endpoint {} went while its hook decided about {}",
                 listener->address, remote);
    return false;
  }
  if (!decision.admit)
    return not_admitted(*listener, request, remote, decision.reason, decision.reason);
  return true;
}

bool Backend::not_admitted(const Listener& listener, fi_info* request,
                           const EndPointAddress& remote, std::string_view reason,
                           std::string_view for_client) {
  NETIO3_WARN("libfabric: refusing connection from {} on {}: {}", remote, listener.address, reason);
  const auto text = detail::encode_refusal(for_client);
  reject_request(listener, request, CM_NOT_ADMITTED, text);
  return false;
}

bool Backend::answer_challenge(const std::shared_ptr<Connection>& conn,
                               const std::optional<Challenge>& challenge) {
  std::string_view problem;
  if (!conn->admission) {
    problem = "the server sent a challenge to a client without a partition key";
  } else if (conn->admission->challenge) {
    problem = "the server answered the proof with another challenge";
  } else if (!challenge) {
    problem = "the server's challenge is malformed";
  } else if (conn->phase != Phase::CONNECTING) {
    problem = "a challenge after the set-up";
  }
  if (problem.empty()) {
    // Closed by the application meanwhile: its posted close ends it.
    if (conn->close_requested.load()) return false;
    conn->admission->challenge = challenge;
    if (connect_again(conn)) return true;
    refuse(conn, RefusalCause::SETUP_FAILED,
           "the second connection request of the partition key's challenge could not be made "
           "(the log says why)");
    return false;
  }
  NETIO3_WARN("libfabric: connection to {} not admitted: {}", conn->remote, problem);
  refuse(conn, RefusalCause::NOT_ADMITTED, problem);
  return false;
}

bool Backend::server_proved(const std::shared_ptr<Connection>& conn, const CmData& peer,
                            std::span<const std::uint8_t> tail) {
  const auto& admission = *conn->admission;
  std::string_view problem;
  if ((peer.flags & CM_KEYED) == 0) {
    problem = "the server holds no partition key (it accepted without a proof)";
  } else if (!admission.challenge) {
    problem = "the server accepted without a challenge";
  } else {
    const auto proof = decode_server_proof(tail);
    if (!proof || !m_key.verify(ADMISSION_PROTOCOL, detail::AdmissionRole::SERVER, admission.nonce,
                                admission.challenge->nonce, proof->identity, proof->proof)) {
      problem = "the server failed to prove the partition key";
    }
  }
  if (problem.empty()) return true;
  NETIO3_WARN("libfabric: connection to {} not admitted: {}", conn->remote, problem);
  refuse(conn, RefusalCause::NOT_ADMITTED, problem);
  return false;
}

void Backend::close_transport(const std::shared_ptr<Connection>& conn) {
  m_registry.forget(conn->id);
  const auto& ending = conn->ending_info;
  if (conn->ep && ending.was_open &&
      (ending.cause == CloseCause::LOCAL || ending.cause == CloseCause::ERROR)) {
    if (ending.cause == CloseCause::LOCAL) {
      const std::lock_guard lock{conn->mutex};
      say_goodbye(*conn);
    }
    fi_shutdown(conn->ep.get(), 0);
  }
  retire(conn);
}

void Backend::close_listener(const std::shared_ptr<Listener>& listener) {
  listener->closed.store(true);
  m_closed_listeners->retire(listener);
}

void Backend::abandon(Connection& conn) noexcept {
  {
    const std::lock_guard lock{conn.mutex};
    if (conn.phase == Phase::OPEN && conn.ep) {
      // The backend is destroyed: an orderly end for the peer.
      say_goodbye(conn);
      fi_shutdown(conn.ep.get(), 0);
    }
    conn.phase = Phase::CLOSED;
    conn.ledger.cancel_all();
  }
  conn.ep.reset();
}

void Backend::release_listener(Listener& listener) {
  {
    const std::lock_guard lock{m_pep_mutex};
    // The request its accept hook is being asked about is answered now, while its passive
    // endpoint can: refused as for a closed listener (the hook's verdict is then ignored).
    if (m_deciding && !m_deciding->answered && m_deciding->listener.get() == &listener &&
        listener.pep) {
      fi_reject(listener.pep.get(), m_deciding->request->handle, nullptr, 0);
      m_deciding->answered = true;
    }
    listener.pep.reset();
  }
  m_registry.forget_listener(listener.id);
}

// A retired connection is freed when the provider holds none of its operations. The tcp,
// net and verbs providers of libfabric 1.17 turn an endpoint's posted operations into
// FI_ECANCELED completions inside fi_close (tcpx_ep_flush_all_queues, xnet_ep_flush_all_queues,
// vrb_flush_sq/vrb_flush_rq), so the count reaches zero within the next complete read of the
// queue. A provider that drops them instead never completes them: once the queue was read
// empty after the close, nothing of the endpoint can come any more, and it is freed then.
void Backend::release_retired(const Domain& domain) {
  std::erase_if(m_retired, [&](const Retired& r) {
    if (r.domain != &domain) return false;
    const std::size_t held = r.conn->provider_ops();
    if (held == 0) return true;
    if (domain.drains == r.drains_at_close) return false;
    NETIO3_DEBUG(
        "libfabric: the provider dropped {} operation(s) of the closed endpoint to {} "
        "without completing them",
        held, r.conn->remote);
    return true;
  });
}

}  // namespace netio3::libfabric
