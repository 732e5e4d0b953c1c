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
// fi_context2). fi_close on an endpoint queues cancellation completions that still point
// to its Ops, so a closed connection is retired and freed only after later complete drains
// of its completion queue.
//
// Threads: callbacks, completions and connection-management events run on the loop
// thread. With ThreadSafetyModel::SAFE the provider is opened FI_THREAD_SAFE and any thread
// may post sends; with UNSAFE it is FI_THREAD_DOMAIN, the connection locks are off, and
// every call must come from the loop thread (checked).

#include "backends/libfabric/libfabric_backend.hpp"

#include <algorithm>
#include <array>
#include <cassert>
#include <optional>
#include <stdexcept>
#include <sys/epoll.h>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "backends/libfabric/fabric.hpp"
#include "common/backend_facade.hpp"
#include "common/buffer_pool.hpp"
#include "common/closed_listeners.hpp"
#include "common/connection.hpp"
#include "common/connection_engine.hpp"
#include "common/endpoint_registry.hpp"
#include "common/endpoint_rules.hpp"
#include "common/log.hpp"
#include "common/notifier.hpp"
#include "common/send_ledger.hpp"
#include "common/setup_deadlines.hpp"
#include "common/sockaddr.hpp"
#include "common/thread_model.hpp"

namespace netio3::libfabric {
namespace {

constexpr std::string_view NAME = "libfabric";
constexpr std::size_t CQ_BATCH = 64;
// Per readiness: read at most this many batches before the loop turns to other work.
constexpr int DRAIN_ROUNDS = 16;
// A closed connection is freed once its domain's completion queue was read empty this many
// times after the close (cancellation completions of fi_close point into it).
constexpr std::uint64_t RETIRE_AFTER_DRAINS = 2;
// Send operations in flight per connection at most (also bounded by the provider's depth).
constexpr std::size_t MAX_SEND_DEPTH = 1024;
constexpr std::size_t MAX_IOV = 16;
// A wait fd that wakes the loop this many times in a row without any event behind it is
// reported: the provider does not support sleeping on its wait objects (seen with the
// 'net' provider of libfabric 1.17), and the loop is busy.
constexpr std::uint64_t SPURIOUS_WAKEUPS_WARN = 1000;
// What the trace log names as the source of a message from a shared receive context.
const EndPointAddress SHARED_SOURCE{"shared-receive-context", 0};

using detail::CloseCause;
using detail::Phase;

struct Connection;
struct RecvBuffers;

// The context of one posted operation.
struct Op {
  fi_context2 ctx{};  // first: the provider's scratch space (FI_CONTEXT / FI_CONTEXT2)
  enum class Kind : std::uint8_t { SEND, RECV } kind{Kind::SEND};
  Connection* conn{nullptr};   // null for a receive posted to a shared receive context
  RecvBuffers* recv{nullptr};  // receives: the buffers it belongs to
  std::uint32_t slot{0};       // sends: index in Connection::send_ops
  detail::SendLedger::Ticket ticket{0};
  std::size_t bytes{0};
  NetworkBuffer* buffer{nullptr};  // receive buffer, or the buffer of a buffered send
};

void* as_context(std::uint64_t id) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(id));
}  // NOLINT
std::uint64_t id_of(const fid_t fid) {
  return fid == nullptr ? 0
                        : static_cast<std::uint64_t>(
                              reinterpret_cast<std::uintptr_t>(fid->context));  // NOLINT
}

// Receive buffers of one endpoint, or shared by several through a shared receive context.
struct RecvBuffers {
  RecvBuffers(std::size_t num_buf, std::size_t buf_size, bool thread_safe)
      : pool{num_buf, buf_size, 0, thread_safe}, ops(num_buf) {}
  detail::BufferPool pool;
  Fid<fid_mr> mr;  // own registration (shared buffers use the domain's)
  void* desc{nullptr};
  Fid<fid_ep> srx;  // shared receive context; null: per-endpoint buffers
  std::vector<Op> ops;
  std::vector<NetworkBuffer*> buffers;  // all of them, posted or being delivered
};

struct Listener {
  Listener(std::uint64_t id_, EndPointAddress address_, const ConnectionParameters& params_,
           Domain* domain_)
      : id{id_}, address{std::move(address_)}, params{params_}, domain{domain_} {}
  const std::uint64_t id;
  EndPointAddress address;
  const ConnectionParameters params;
  Domain* const domain;
  std::shared_ptr<RecvBuffers> shared_recv;  // recv_params.use_shared_receive_buffers
  Fid<fid_pep> pep;
  // Set by close_listen_endpoint. The pep stays open for a while after, rejecting what
  // arrives (common/closed_listeners.hpp).
  std::atomic<bool> closed{false};
};

struct Connection : detail::ConnectionBase {
  Connection(std::uint64_t id_, EndPointAddress remote_, const ConnectionParameters& params_,
             std::uint64_t listener_id_, Domain* domain_, bool thread_safe, Phase initial)
      : ConnectionBase{id_, std::move(remote_), params_, listener_id_, thread_safe, initial},
        domain{domain_} {}

  Domain* const domain;
  std::shared_ptr<RecvBuffers> recv;  // null: this endpoint cannot receive

  // Under `mutex`.
  std::size_t peer_recv_size{0};
  std::uint64_t unsent_bytes{0};
  void* send_desc{nullptr};
  Fid<fid_mr> send_mr;
  std::span<std::uint8_t> region;  // zero-copy
  Fid<fid_mr> region_mr;
  void* region_desc{nullptr};
  std::vector<std::array<std::uint8_t, MAX_HEADER_SIZE>> header_slots;
  Fid<fid_mr> header_mr;
  void* header_desc{nullptr};
  std::vector<Op> send_ops;  // never resized: Ops are operation contexts
  std::vector<std::uint32_t> free_send_ops;

  Fid<fid_ep> ep;  // last: closed first
};

class Backend : public detail::ConnectionEngine<Backend, Connection, Listener>,
                public std::enable_shared_from_this<Backend> {
 public:
  static constexpr BackendType TYPE = BackendType::LIBFABRIC;
  using Engine = detail::ConnectionEngine<Backend, Connection, Listener>;

  Backend(NetworkConfig config, std::shared_ptr<BaseEventLoop> loop)
      : Engine{NAME, config, std::move(loop), config.thread_safety},
        m_provider{choose_provider(m_config.mode)} {
    const auto& shared_tx = m_config.shared_send_buffers;
    if (shared_tx.use_shared_send_buffers) {
      m_shared_send_pool =
          std::make_unique<detail::BufferPool>(shared_tx.num_buf, shared_tx.buf_size, 0, safe());
    }
    NETIO3_DEBUG("libfabric: provider '{}'{}, thread safety {}", m_provider.name,
                 m_provider.from_environment ? " (FI_PROVIDER)" : "", m_config.thread_safety);
  }

  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  Backend(Backend&&) = delete;
  Backend& operator=(Backend&&) = delete;
  ~Backend() = default;

  void start() {
    start_engine();
    std::weak_ptr<Backend> weak = weak_from_this();
    m_prepare = m_loop->add_polling_hook([weak] {
      auto self = weak.lock();
      return !self || self->may_sleep();
    });
    m_kick = m_loop->create_signal([weak] {
      if (auto self = weak.lock()) self->on_kick();
    });
    m_closed_listeners.emplace(*m_loop, m_config.limits.connect_timeout,
                               [weak](Listener& listener) {
                                 if (auto self = weak.lock()) self->release_listener(listener);
                               });
  }

  void shutdown() noexcept {
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

  // ---- API ---------------------------------------------------------------------------

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
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
    const EndPointAddress actual = listener->address;
    m_registry.check_listen_free(held, actual);
    m_registry.index(listener);
    m_registry.add_listener(held, actual, std::move(listener));
    NETIO3_DEBUG("libfabric: listening on {} (provider {})", actual, domain.provider());
    return actual;
  }

  void open_active_endpoint(const EndPointAddress& address, const ConnectionParameters& params) {
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
    track_setup(conn);
    const auto data = encode_cm_data(CmData{receive_size(*conn)});
    const int rc = fi_connect(conn->ep.get(), info->dest_addr, data.data(), data.size());
    if (rc != 0) {
      // Reported like a refusal, from the loop (never from inside this call).
      close_later(conn, fmt::format("fi_connect failed: {}", fi_error(rc)), CloseCause::ERROR);
      return;
    }
    NETIO3_DEBUG("libfabric: connecting to {} (provider {})", address, domain.provider());
  }

  NetioStatus post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer) {
    const iovec iov{buffer->data(), buffer->size()};
    std::array<void*, 1> desc{};
    {
      const std::lock_guard lock{conn->mutex};
      desc[0] = conn->send_desc;
    }
    return post_send(*conn, {}, std::span{&iov, 1}, desc, detail::PendingSend{buffer->id(), buffer},
                     buffer->size());
  }

  NetioStatus send_data(const EndPointAddress& address, std::span<const iovec> iov,
                        std::span<const std::uint8_t> header, std::uint64_t key) {
    const ApiCall call{*this, "send_data"};
    const auto conn = zero_copy_target(address, iov, header);
    if (!conn) return NetioStatus::FAILED;
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
                     detail::PendingSend{key, nullptr}, size);
  }

  NetioStatus send_data_copy(const EndPointAddress& address, std::span<const iovec> /*iov*/,
                             std::span<const std::uint8_t> /*header*/, std::uint64_t /*key*/) {
    const ApiCall call{*this, "send_data_copy"};
    (void)connection_for(address, "send_data_copy");
    throw NotSupported(
        "libfabric: send_data_copy is not supported (RDMA sends from registered memory); use "
        "buffered or zero-copy sending");
  }

 private:
  [[nodiscard]] bool safe() const noexcept { return m_thread.safe(); }

  static void fi_check(std::string_view what, long rc) {
    if (rc < 0) throw std::runtime_error(fmt::format("{} failed: {}", what, fi_error(rc)));
  }

  static void check_parameters(const ConnectionParameters& params) {
    if (params.send_zero_copy_params.mr_start != nullptr &&
        params.send_buffered_params.num_buf > 0) {
      throw InvalidConnectionParameters(
          "libfabric: an endpoint sends either buffered (send_buffered_params) or zero-copy "
          "(send_zero_copy_params), not both");
    }
  }

  template <typename MakeError>
  Info fabric_info(const EndPointAddress& address, bool local, MakeError&& make_error) {
    try {
      return get_info(m_provider, m_config.thread_safety, address, local);
    } catch (const std::runtime_error& e) {
      throw make_error(e.what());
    }
  }

  template <typename MakeError>
  Domain& open_domain(const fi_info& info, MakeError&& make_error) {
    try {
      return domain_for(info);
    } catch (const std::runtime_error& e) {
      throw make_error(fmt::format("provider '{}': {}", info.fabric_attr->prov_name, e.what()));
    }
  }

  // ---- domains ---------------------------------------------------------------------

  struct DomainFds {
    FdHandle eq;
    FdHandle cq;
  };

  Domain& domain_for(const fi_info& info) {
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
      if (!self) return;
      const std::size_t handled = self->drain_eq(*d);
      if (!self->shut_down()) self->on_wait_fd(*d, handled);
    });
    fds.cq = m_loop->add_fd(d->cq_fd(), EPOLLIN, [weak, d](std::uint32_t) {
      auto self = weak.lock();
      if (!self) return;
      const std::size_t handled = self->drain_cq(*d);
      if (!self->shut_down()) self->on_wait_fd(*d, handled);
    });
    m_domain_fds.push_back(std::move(fds));
    m_domains.push_back(std::move(domain));
    NETIO3_DEBUG(
        "libfabric: opened provider '{}' fabric '{}' domain '{}' (mr_mode {:#x}, inject {}, "
        "iov_limit {}, tx depth {}, shared rx {})",
        d->provider(), d->info().fabric_attr->name, d->info().domain_attr->name,
        d->info().domain_attr->mr_mode, d->info().tx_attr->inject_size, d->iov_limit(),
        d->tx_depth(), d->has_shared_rx());
    return *d;
  }

  // ---- receive buffers -------------------------------------------------------------

  std::shared_ptr<RecvBuffers> make_buffers(Domain& domain, std::size_t num_buf,
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

  // Receive buffers shared through a shared receive context (or, where the provider has
  // none, nullptr: every endpoint then gets buffers of its own).
  std::shared_ptr<RecvBuffers> make_shared_recv(Domain& domain, const RecvParameters& params) {
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

  // The backend-wide shared receive buffers of `domain` (NetworkConfig), if configured.
  std::shared_ptr<RecvBuffers> global_recv(Domain& domain) {
    const auto& rx = m_config.shared_receive_buffers;
    if (!rx.use_shared_receive_buffers) return nullptr;
    const std::lock_guard lock{m_domains_mutex};
    auto& recv = m_global_recv[&domain];
    if (!recv) {
      recv =
          make_shared_recv(domain, RecvParameters{.buf_size = rx.buf_size, .num_buf = rx.num_buf});
    }
    return recv;
  }

  void post_receive(Op& op, fid_ep* target) const {
    const int rc = fi_recv(target, op.buffer->data(), op.buffer->capacity(), op.recv->desc, 0, &op);
    if (rc != 0) {
      throw std::runtime_error(fmt::format("fi_recv failed: {}", fi_error(rc)));
    }
  }

  static std::size_t receive_size(const Connection& conn) {
    return conn.recv ? conn.recv->pool.buf_size() : 0;
  }

  // ---- connections -----------------------------------------------------------------

  std::shared_ptr<Connection> make_connection(const EndPointAddress& remote,
                                              const ConnectionParameters& params,
                                              std::uint64_t listener_id, Domain& domain,
                                              Phase initial, std::shared_ptr<RecvBuffers> shared) {
    auto conn = std::make_shared<Connection>(next_id(), remote, params, listener_id, &domain,
                                             safe(), initial);
    // Receive buffers: the shared ones if there are any; else the endpoint's own, as asked
    // by recv_params or, where shared buffers are configured but the provider has no shared
    // receive context, as configured for the shared ones.
    RecvParameters own = params.recv_params;
    const auto& configured = m_config.shared_receive_buffers;
    if (own.num_buf == 0 && configured.use_shared_receive_buffers) {
      own = RecvParameters{.buf_size = configured.buf_size, .num_buf = configured.num_buf};
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
        conn->send_desc = domain.shared_registration(conn->send_pool->region());
      }
    }
    // Send contexts (and, for zero-copy, registered header slots) only for an endpoint that
    // can send: a receive-only connection costs no memory per transmit-queue entry.
    const bool zero_copy = zc.mr_start != nullptr;
    const bool can_send = zero_copy || conn->send_pool != nullptr;
    const std::size_t depth =
        can_send ? std::clamp<std::size_t>(domain.tx_depth(), 1, MAX_SEND_DEPTH) : 0;
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

  void open_endpoint(Connection& conn, fi_info* info) const {
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

  [[nodiscard]] static EndpointCapabilities capabilities(const Connection& conn) {
    return EndpointCapabilities{.send_buffered = conn.send_pool != nullptr,
                                .send_copy = false,
                                .send_zero_copy = conn.region_mr != nullptr,
                                .receive = conn.recv != nullptr};
  }

  // ---- sending ---------------------------------------------------------------------

  // Posts one message: `header` (copied into a registered slot) followed by `payload`.
  NetioStatus post_send(Connection& conn, std::span<const std::uint8_t> header,
                        std::span<const iovec> payload, std::span<void* const> payload_desc,
                        detail::PendingSend pending, std::size_t size) {
    {
      const std::lock_guard lock{conn.mutex};
      if (conn.close_requested.load(std::memory_order_relaxed) || conn.ending()) {
        return NetioStatus::FAILED;
      }
      if (conn.phase != Phase::OPEN) return NetioStatus::NO_RESOURCES;  // still connecting
      if (size > conn.peer_recv_size) {
        NETIO3_WARN(
            "libfabric: send to {}: a message of {} bytes exceeds the peer's receive "
            "buffers of {} bytes",
            conn.remote, size, conn.peer_recv_size);
        return NetioStatus::FAILED;
      }
      const std::size_t count = payload.size() + (header.empty() ? 0 : 1);
      if (count > std::min(conn.domain->iov_limit(), MAX_IOV) ||
          payload.size() > payload_desc.size()) {
        NETIO3_WARN("libfabric: send to {}: {} pieces exceed the provider's iov_limit {}",
                    conn.remote, count, conn.domain->iov_limit());
        return NetioStatus::FAILED;
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
      const ssize_t rc =
          n == 1 ? fi_send(conn.ep.get(), iov[0].iov_base, iov[0].iov_len, desc[0], 0, &op)
                 : fi_sendv(conn.ep.get(), iov.data(), desc.data(), n, 0, &op);
      if (rc != 0) {
        conn.ledger.retract(op.ticket);
        if (rc == -FI_EAGAIN) return NetioStatus::NO_RESOURCES;
        NETIO3_WARN("libfabric: send to {} failed: {}", conn.remote, fi_error(rc));
        return NetioStatus::FAILED;
      }
      conn.free_send_ops.pop_back();
      conn.unsent_bytes += size;
    }
    NETIO3_TRACE("libfabric: send to {} key={} size={}", conn.remote, pending.key, size);
    // Manual progress: the loop must read the queue for the transfer to move on.
    if (!m_loop->in_loop_thread() && !m_kick_pending.exchange(true)) m_kick.fire();
    return NetioStatus::OK;
  }

  // ---- loop thread -------------------------------------------------------------------

  void assert_loop_thread() const noexcept { assert(m_loop->in_loop_thread()); }

  void on_kick() {
    m_kick_pending.store(false);
    drain_all();
  }

  // The loop thread's view of m_domains, refreshed when a domain was added (domains are
  // only added until shutdown), so that polling rounds do not allocate. Walk it by index: a
  // callback inside a drain may open a connection and add a domain.
  const std::vector<Domain*>& loop_domains() {
    assert_loop_thread();
    const std::lock_guard lock{m_domains_mutex};
    if (m_loop_domains.size() != m_domains.size()) {
      m_loop_domains.clear();
      for (const auto& d : m_domains) m_loop_domains.push_back(d.get());
    }
    return m_loop_domains;
  }

  void drain_all() {
    const auto& domains = loop_domains();
    for (std::size_t i = 0; i < domains.size(); ++i) {
      Domain* d = domains[i];
      if (shut_down()) return;
      drain_eq(*d);
      if (shut_down()) return;
      drain_cq(*d);
    }
  }

  // The prepare hook: true when every queue is empty and armed (fi_trywait), so the loop
  // may sleep on the wait fds; otherwise the queues are drained and the loop polls again.
  bool may_sleep() {
    assert_loop_thread();
    if (shut_down()) return true;
    const auto& domains = loop_domains();
    bool sleep = true;
    if (m_loop->polling()) {
      // Busy-polling: the loop will not sleep this round; read the queues (which also
      // drives the provider's progress) instead of arming them.
      for (std::size_t i = 0; i < domains.size(); ++i) {
        Domain* d = domains[i];
        if (drain_eq(*d) > 0) sleep = false;
        if (shut_down()) return true;
        if (drain_cq(*d) > 0) sleep = false;
        if (shut_down()) return true;
      }
      return sleep;
    }
    for (std::size_t i = 0; i < domains.size(); ++i) {
      Domain* d = domains[i];
      std::array<fid*, 2> fids{&d->eq()->fid, &d->cq()->fid};
      if (fi_trywait(d->fabric(), fids.data(), static_cast<int>(fids.size())) != FI_SUCCESS) {
        sleep = false;
        drain_eq(*d);
        if (shut_down()) return true;
        drain_cq(*d);
        if (shut_down()) return true;
      }
    }
    return sleep;
  }

  // A wait fd woke the loop and `handled` events were behind it.
  void on_wait_fd(Domain& domain, std::size_t handled) {
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

  // One event queue entry, with room for connection data.
  static constexpr std::size_t EQ_ENTRY_SIZE = sizeof(fi_eq_cm_entry) + 256;

  // Shutdown: reads what is left on `domain`'s event queue, refusing connection requests
  // (callbacks are off: nothing else is reported).
  void refuse_queued_requests(Domain& domain) noexcept {
    alignas(fi_eq_cm_entry) std::array<std::uint8_t, EQ_ENTRY_SIZE> buffer{};
    for (int i = 0; i < 100'000; ++i) {
      std::uint32_t event = 0;
      const ssize_t rc = fi_eq_read(domain.eq(), &event, buffer.data(), buffer.size(), 0);
      if (rc == -FI_EAVAIL) {
        fi_eq_err_entry err{};
        if (fi_eq_readerr(domain.eq(), &err, 0) < 0) return;
        continue;
      }
      if (rc < 0) return;
      if (event != FI_CONNREQ) continue;
      const auto* entry = reinterpret_cast<const fi_eq_cm_entry*>(buffer.data());  // NOLINT
      const Info info{entry->info};
      refuse_request(m_registry.listener_by_id(id_of(entry->fid)).get(), info->handle);
    }
  }

  // Refuses a connection request without a reason: rejected through its listener's passive
  // endpoint while that is open (the client is told at once), else its handle is closed.
  void refuse_request(const Listener* listener, fid_t handle) noexcept {
    const std::lock_guard lock{m_pep_mutex};
    if (listener != nullptr && listener->pep) {
      fi_reject(listener->pep.get(), handle, nullptr, 0);
    } else if (handle != nullptr) {
      fi_close(handle);
    }
  }

  // Both drains return how many events or completions they handled.
  std::size_t drain_eq(Domain& domain) {
    assert_loop_thread();
    std::size_t handled = 0;
    alignas(fi_eq_cm_entry) std::array<std::uint8_t, EQ_ENTRY_SIZE> buffer{};
    for (int i = 0; i < DRAIN_ROUNDS * 4 && !shut_down(); ++i) {
      std::uint32_t event = 0;
      const ssize_t rc = fi_eq_read(domain.eq(), &event, buffer.data(), buffer.size(), 0);
      if (rc == -FI_EAGAIN) return handled;
      ++handled;
      if (rc == -FI_EAVAIL) {
        fi_eq_err_entry err{};
        if (fi_eq_readerr(domain.eq(), &err, 0) < 0) return handled;
        on_eq_error(domain, err);
        continue;
      }
      if (rc < 0) {
        NETIO3_ERROR("libfabric: fi_eq_read failed: {}", fi_error(rc));
        return handled;
      }
      const auto* entry = reinterpret_cast<const fi_eq_cm_entry*>(buffer.data());  // NOLINT
      const std::size_t data_len = static_cast<std::size_t>(rc) > sizeof(fi_eq_cm_entry)
                                       ? static_cast<std::size_t>(rc) - sizeof(fi_eq_cm_entry)
                                       : 0;
      on_cm_event(domain, event, *entry, {entry->data, data_len});
    }
    return handled;
  }

  std::size_t drain_cq(Domain& domain) {
    assert_loop_thread();
    std::array<fi_cq_data_entry, CQ_BATCH> entries{};
    std::size_t handled = 0;
    for (int round = 0; round < DRAIN_ROUNDS; ++round) {
      if (shut_down()) return handled;
      const ssize_t n = fi_cq_read(domain.cq(), entries.data(), entries.size());
      if (n == -FI_EAGAIN) {
        ++domain.drains;
        release_retired(domain);
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
        on_completion(entries.at(static_cast<std::size_t>(i)));
        if (shut_down()) return handled;
      }
    }
    return handled;
  }

  void on_completion(const fi_cq_data_entry& entry) {
    auto* op = static_cast<Op*>(entry.op_context);
    if (op == nullptr) return;
    if (op->kind == Op::Kind::RECV) {
      on_received(*op, entry.len);
    } else {
      on_send_done(*op, true, {});
    }
  }

  void on_completion_error(Domain& domain, const fi_cq_err_entry& err) {
    auto* op = static_cast<Op*>(err.op_context);
    std::array<char, 256> detail_text{};
    const char* detail = fi_cq_strerror(domain.cq(), err.prov_errno, err.err_data,
                                        detail_text.data(), detail_text.size());
    const std::string why =
        fmt::format("{} ({})", fi_strerror(err.err), detail != nullptr ? detail : "");
    if (op == nullptr) {
      NETIO3_WARN("libfabric: completion error without context: {}", why);
      return;
    }
    if (op->kind == Op::Kind::SEND) {
      on_send_done(*op, false, why);
      return;
    }
    // A failed or cancelled receive.
    if (err.err == FI_ECANCELED) return;  // its endpoint (or shared context) is closing
    Connection* conn = op->conn;
    if (conn == nullptr) {
      NETIO3_WARN("libfabric: receive into a shared buffer failed: {}", why);
      repost_shared(*op);
      return;
    }
    if (auto shared = m_registry.by_id(conn->id)) {
      const auto reason =
          fmt::format("receive failed: {}{}", why,
                      err.err == FI_ETRUNC ? " (message larger than the receive buffers)" : "");
      NETIO3_WARN("libfabric: connection with {}: {}", conn->remote, reason);
      close(shared, reason, CloseCause::ERROR);
    }
  }

  void on_received(Op& op, std::size_t len) {
    Connection* conn = op.conn;
    const std::span<const std::uint8_t> bytes{op.buffer->data(),
                                              std::min(len, op.buffer->capacity())};
    if (conn == nullptr) {
      m_notifier.data(SHARED_SOURCE, bytes);
      if (!shut_down()) repost_shared(op);
      return;
    }
    // Closing: the buffer is not posted again.
    if (!still_open(*conn) || !deliver(*conn, bytes)) return;
    try {
      post_receive(op, conn->ep.get());
    } catch (const std::runtime_error& e) {
      if (auto shared = m_registry.by_id(conn->id)) close(shared, e.what(), CloseCause::ERROR);
    }
  }

  void repost_shared(Op& op) {
    try {
      post_receive(op, op.recv->srx.get());
    } catch (const std::runtime_error& e) {
      NETIO3_ERROR("libfabric: shared receive buffer lost: {}", e.what());
    }
  }

  void on_send_done(Op& op, bool ok, const std::string& why) {
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

  void on_cm_event(Domain& domain, std::uint32_t event, const fi_eq_cm_entry& entry,
                   std::span<const std::uint8_t> data) {
    switch (event) {
      case FI_CONNREQ:
        on_connection_request(domain, entry, data);
        break;
      case FI_CONNECTED:
        if (auto conn = m_registry.by_id(id_of(entry.fid))) on_connected(conn, data);
        break;
      case FI_SHUTDOWN:
        if (auto conn = m_registry.by_id(id_of(entry.fid))) {
          close(conn, "peer closed the connection", CloseCause::PEER);
        }
        break;
      default:
        NETIO3_DEBUG("libfabric: ignoring event queue event {}", event);
        break;
    }
  }

  void on_eq_error(Domain& domain, const fi_eq_err_entry& err) {
    std::array<char, 256> detail_text{};
    const char* detail = fi_eq_strerror(domain.eq(), err.prov_errno, err.err_data,
                                        detail_text.data(), detail_text.size());
    const std::string why =
        fmt::format("{}{}{}", fi_strerror(err.err), detail != nullptr ? ": " : "",
                    detail != nullptr ? detail : "");
    if (auto conn = m_registry.by_id(id_of(err.fid))) {
      if (err.err == FI_ECONNREFUSED && refused_address_in_use(err) &&
          conn->phase == Phase::CONNECTING && reconnect_from_new_source_port(conn)) {
        return;
      }
      close(conn, why, CloseCause::ERROR);
      return;
    }
    NETIO3_DEBUG("libfabric: event queue error for no known endpoint: {}", why);
  }

  // The reject data of a netio3 server that has a connection from our source port already.
  static bool refused_address_in_use(const fi_eq_err_entry& err) {
    if (err.err_data == nullptr || err.err_data_size < CM_DATA_SIZE) return false;
    std::string ignored;
    const auto data = decode_cm_data(
        {static_cast<const std::uint8_t*>(err.err_data), err.err_data_size}, ignored);
    return data && (data->flags & CM_REFUSED_ADDRESS_IN_USE) != 0;
  }

  // The server refused `old` because it has a connection from its source address and port:
  // a new endpoint, from a source port of its own, takes its place under the same address (at
  // most SOURCE_PORT_RETRIES times), and `old` goes without a callback. False when it may not
  // or could not; the caller then closes `old`.
  bool reconnect_from_new_source_port(const std::shared_ptr<Connection>& old) {
    if (!detail::retry_from_new_source_port(*old, NAME)) return false;
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
    track_setup(conn);
    close(old, "superseded", CloseCause::ERROR, false);
    const auto data = encode_cm_data(CmData{receive_size(*conn)});
    const int rc = fi_connect(conn->ep.get(), info->dest_addr, data.data(), data.size());
    if (rc != 0) {
      // Reported from the loop, after the event being handled.
      close_later(conn, fmt::format("fi_connect failed: {}", fi_error(rc)), CloseCause::ERROR);
    }
    return true;
  }

  // Closes the endpoint of a CLOSED connection (which queues cancellations for what was still
  // posted) and keeps the connection until the provider is done with it.
  void retire(const std::shared_ptr<Connection>& conn) {
    conn->ep.reset();
    m_retired.push_back(Retired{conn->domain, conn->domain->drains, conn});
  }

  // retire() for a connection that never was registered (a failed or abandoned retry).
  void retire_unregistered(const std::shared_ptr<Connection>& conn) {
    {
      const std::lock_guard lock{conn->mutex};
      conn->phase = Phase::CLOSED;
    }
    retire(conn);
  }

  void on_connection_request(Domain& domain, const fi_eq_cm_entry& entry,
                             std::span<const std::uint8_t> data) {
    Info info{entry.info};  // ours to free
    const auto listener = m_registry.listener_by_id(id_of(entry.fid));
    // A request for a closed listener is refused at once (the peer does not wait for its
    // set-up to time out, and the provider frees the request's socket).
    const auto refuse_closed = [&] {
      refuse_request(listener.get(), info->handle);
      NETIO3_DEBUG("libfabric: refused a connection request on a closed listen endpoint");
    };
    if (!listener || listener->closed.load()) {
      refuse_closed();
      return;
    }
    const auto reject = [&](std::string_view why, std::uint16_t flags = 0) {
      NETIO3_WARN("libfabric: refusing a connection on {}: {}", listener->address, why);
      const auto refusal = encode_cm_data(CmData{.recv_buf_size = 0, .flags = flags});
      fi_reject(listener->pep.get(), info->handle, refusal.data(), refusal.size());
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
    std::shared_ptr<Connection> conn;
    {
      const auto held = m_registry.lock();
      if (!m_registry.has_listener(held, listener->address)) {
        refuse_closed();  // closed meanwhile
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
        conn->peer_recv_size = peer->recv_buf_size;
        open_endpoint(*conn, info.get());
      } catch (const std::exception& e) {
        reject(e.what());
        return;
      }
      m_registry.index(conn);
      m_registry.add_connection(held, conn);
    }
    track_setup(conn);
    const auto reply = encode_cm_data(CmData{receive_size(*conn)});
    const int rc = fi_accept(conn->ep.get(), reply.data(), reply.size());
    if (rc != 0) {
      close(conn, fmt::format("fi_accept failed: {}", fi_error(rc)), CloseCause::ERROR);
      return;
    }
    NETIO3_DEBUG("libfabric: accepting connection from {} on {}", *remote, listener->address);
  }

  void on_connected(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> data) {
    if (conn->phase == Phase::CONNECTING) {
      std::string error;
      const auto peer = decode_cm_data(data, error);
      if (!peer) {
        NETIO3_WARN("libfabric: connection with {}: {}", conn->remote, error);
        close(conn, error, CloseCause::ERROR);
        return;
      }
      const std::lock_guard lock{conn->mutex};
      conn->peer_recv_size = peer->recv_buf_size;
    }
    if (conn->setting_up()) (void)established(conn, capabilities(*conn));
  }

  // ---- the transport (detail::TransportOf; post_buffer is with the API) -------------------
 public:
  // Closing: the endpoint goes (after a shutdown message to the peer of an open connection
  // that we close); the connection is kept until the provider is done with it (retire).
  void close_transport(const std::shared_ptr<Connection>& conn) {
    m_registry.forget(conn->id);
    const auto& ending = conn->ending_info;
    if (conn->ep && ending.was_open && ending.cause != CloseCause::PEER) {
      fi_shutdown(conn->ep.get(), 0);
    }
    retire(conn);
  }

  // What the provider still holds (cancellations of posted operations) does not delay the
  // report: the ledger reports those sends as cancelled and ignores their completions.
  [[nodiscard]] static bool quiescent(const Connection& /*conn*/) { return true; }

  void close_listener(const std::shared_ptr<Listener>& listener) {
    listener->closed.store(true);
    m_closed_listeners->retire(listener);
  }

  // Without callbacks (backend shutdown).
  static void abandon(Connection& conn) noexcept {
    {
      const std::lock_guard lock{conn.mutex};
      conn.phase = Phase::CLOSED;
      conn.ledger.cancel_all();
    }
    conn.ep.reset();
  }

 private:
  void release_listener(Listener& listener) {
    {
      const std::lock_guard lock{m_pep_mutex};
      listener.pep.reset();
    }
    m_registry.forget_listener(listener.id);
  }

  void release_retired(const Domain& domain) {
    std::erase_if(m_retired, [&](const Retired& r) {
      return r.domain == &domain && domain.drains >= r.drains_at_close + RETIRE_AFTER_DRAINS;
    });
  }

  struct Retired {
    const Domain* domain;
    std::uint64_t drains_at_close;
    std::shared_ptr<Connection> conn;
  };

  const ProviderChoice m_provider;
  std::unique_ptr<detail::BufferPool> m_shared_send_pool;

  std::mutex m_domains_mutex;  // m_domains, m_domain_fds, m_global_recv
  std::vector<std::unique_ptr<Domain>> m_domains;
  std::vector<DomainFds> m_domain_fds;
  std::vector<Domain*> m_loop_domains;  // loop thread (and m_domains_mutex): loop_domains()
  std::unordered_map<const Domain*, std::shared_ptr<RecvBuffers>> m_global_recv;

  // Loop thread only.
  std::vector<Retired> m_retired;

  std::optional<detail::ClosedListeners<Listener>> m_closed_listeners;
  std::mutex m_pep_mutex;  // closing a closed listener's pep vs. rejecting with it

  std::atomic<bool> m_kick_pending{false};
  EventSignalHandle m_kick;
  PrepareHookHandle m_prepare;
};

}  // namespace

std::unique_ptr<NetworkBackend> create_backend(NetworkConfig config,
                                               std::shared_ptr<BaseEventLoop> loop) {
  return std::make_unique<detail::BackendFacade<Backend>>(std::move(config), std::move(loop));
}

}  // namespace netio3::libfabric
