// libfabric backend, the loop thread: reading the event and completion queues (and
// handing what they hold to the set-up, completion and closing code).

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

}  // namespace netio3::libfabric
