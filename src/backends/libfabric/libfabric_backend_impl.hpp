// The libfabric backend's types and its class (see libfabric_backend.cpp for how it works).
// Its definitions are split by concern: libfabric_backend.cpp (lifecycle, API, domains, receive
// buffers, sending), progress.cpp (the loop thread: reading the event and completion queues),
// completions.cpp (messages received, sends finished), peer_protocol.cpp (connection data,
// heartbeats, goodbyes), accepting.cpp and connecting.cpp (the server's and the client's side
// of the set-up, admission), closing.cpp (a connection's and a listener's end).

#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <optional>
#include <stdexcept>
#include <sys/epoll.h>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "backends/libfabric/admission.hpp"
#include "backends/libfabric/fabric.hpp"
#include "backends/libfabric/libfabric_backend.hpp"
#include "common/backend_facade.hpp"
#include "common/buffer_pool.hpp"
#include "common/closed_listeners.hpp"
#include "common/connection.hpp"
#include "common/connection_engine.hpp"
#include "common/endpoint_registry.hpp"
#include "common/endpoint_rules.hpp"
#include "common/log.hpp"
#include "common/log_limiter.hpp"
#include "common/notifier.hpp"
#include "common/send_ledger.hpp"
#include "common/setup_deadlines.hpp"
#include "common/sockaddr.hpp"
#include "common/thread_model.hpp"

namespace netio3::libfabric {

// Internal: not exported from the shared library, and not interposable, so that calls between
// the backend's files are bound (and inlined) as within one file.
#pragma GCC visibility push(hidden)

constexpr std::string_view NAME = "libfabric";
constexpr std::size_t CQ_BATCH = 64;
// Per readiness: read at most this many batches before the loop turns to other work.
constexpr int DRAIN_ROUNDS = 16;
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
using detail::Payload;
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

// libfabric carries an opaque context pointer; netio3 stores the connection id in it.
inline void* as_context(std::uint64_t id) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(id));  // NOLINT
}
inline std::uint64_t id_of(fid_t fid) {
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
  // Receives posted and not completed yet (the provider holds them). Per-endpoint buffers
  // are posted on the thread that opens the endpoint, then on the loop thread.
  std::atomic<std::size_t> posted{0};
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
  // The connection data the provider carries (FI_OPT_CM_DATA_SIZE; verbs' 55 when it does not
  // say): bounds the reason of a refusal.
  std::size_t cm_data_size{55};
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
  bool recv_for_acks_only{false};     // ACK_RECEIVE_BUFFERS: no data is asked for

  // A keyed client's admission (admission.hpp): its nonce, and the server's challenge once the
  // first request was answered with one. Set before the connection is registered, then
  // loop thread only.
  struct ClientAdmission {
    detail::AdmissionNonce nonce{};
    std::optional<Challenge> challenge{};
  };
  std::optional<ClientAdmission> admission;
  // A client's set-up ends by this time, over all its requests (the second of a keyed client,
  // another source port).
  std::chrono::steady_clock::time_point setup_deadline{};

  // Under `mutex`.
  std::size_t peer_recv_size{0};
  std::uint64_t peer_heartbeat_token{0};  // the CQ data of heartbeats to the peer
  bool peer_takes_goodbye{false};         // CM_GOODBYE and a token: say_goodbye sends one
  std::uint64_t data_tag{0};  // CQ data of every data message to the peer (CM_TAG_DATA), or 0
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

  // Operations of this connection the provider holds: sends in flight and, with buffers of
  // its own, receives posted. Their completions point into this object.
  [[nodiscard]] std::size_t provider_ops() const {
    std::size_t sends = 0;
    {
      const std::lock_guard lock{mutex};
      sends = send_ops.size() - free_send_ops.size();
    }
    return sends + (recv && !recv->srx ? recv->posted.load() : 0);
  }
};

class Backend : public detail::ConnectionEngine<Backend, Connection, Listener>,
                public std::enable_shared_from_this<Backend> {
 public:
  static constexpr BackendType TYPE = BackendType::LIBFABRIC;
  // send_data_copy: RDMA sends from registered memory.
  static constexpr std::string_view NO_COPY_SENDS =
      "(RDMA sends from registered memory); use buffered or zero-copy sending";
  using Engine = detail::ConnectionEngine<Backend, Connection, Listener>;

  Backend(const NetworkConfig& config, std::shared_ptr<BaseEventLoop> loop)
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

  void start();

  void shutdown() noexcept;

  // ---- API ---------------------------------------------------------------------------

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                       const ConnectionParameters& params);

  void open_active_endpoint(const EndPointAddress& address, const ConnectionParameters& params);

  NetioStatus post_buffer(const std::shared_ptr<Connection>& conn, NetworkBuffer* buffer);

  NetioStatus post_data(const std::shared_ptr<Connection>& conn,
                        std::span<const std::uint8_t> header, std::span<const iovec> iov,
                        Payload payload, detail::PendingSend pending);

  // Statistics (under the connection's lock): bytes posted and not completed.
  [[nodiscard]] static std::uint64_t queued_bytes(const Connection& conn) {
    return conn.unsent_bytes;
  }

  // An empty message with remote CQ data, injected (common/liveness.hpp).
  void send_heartbeat(const std::shared_ptr<Connection>& conn);
  bool send_ack(const std::shared_ptr<Connection>& conn, std::uint64_t count);

 private:
  [[nodiscard]] bool safe() const noexcept { return m_thread.safe(); }

  static void fi_check(std::string_view what, long rc) {
    if (rc < 0) throw std::runtime_error(fmt::format("{} failed: {}", what, fi_error(rc)));
  }

  static void check_parameters(const ConnectionParameters& params);

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
    EventTimerHandle resume;  // ends an accept pause (pause_if_short_of_descriptors)
  };
  // The fds of `domain` (under m_domains_mutex: m_domain_fds runs beside m_domains).
  DomainFds& fds_of(const Domain& domain);

  Domain& domain_for(const fi_info& info);

  // ---- receive buffers -------------------------------------------------------------

  std::shared_ptr<RecvBuffers> make_buffers(Domain& domain, std::size_t num_buf,
                                            std::size_t buf_size, bool shared) const;

  // Receive buffers shared through a shared receive context (or, where the provider has
  // none, nullptr: every endpoint then gets buffers of its own).
  std::shared_ptr<RecvBuffers> make_shared_recv(Domain& domain, const RecvParameters& params);

  // The backend-wide shared receive buffers of `domain` (NetworkConfig), if configured.
  std::shared_ptr<RecvBuffers> global_recv(Domain& domain);

  void post_receive(Op& op, fid_ep* target) const;

  static std::size_t receive_size(const Connection& conn) {
    return conn.recv ? conn.recv->pool.buf_size() : 0;
  }

  // The connection data this side sends for `conn` (fabric.hpp): heartbeats where the
  // provider carries remote CQ data, a token where the connection can receive.
  [[nodiscard]] static CmData own_cm_data(const Connection& conn);
  // The peer's connection data: its receive size and what it does with heartbeats.
  // False when this side's sends are to be acknowledged and the peer cannot
  // (detail::PEER_CANNOT_ACKNOWLEDGE).
  [[nodiscard]] static bool take_peer_cm_data(Connection& conn, const CmData& peer);
  // What a client sends with fi_connect: its CmData and, for a keyed client, its admission
  // request (the first, or the answer to the server's challenge).
  [[nodiscard]] std::vector<std::uint8_t> connect_data(const Connection& conn) const;

  // ---- connections -----------------------------------------------------------------

  // A connection's id, which is also its token in the CQ data of heartbeats and of tagged
  // messages to a shared receive context: random below the tag bit (63 bits where the CQ data
  // has 8 bytes, 31 on verbs' 4), so that an admitted peer cannot name another connection.
  [[nodiscard]] std::uint64_t new_token(const Domain& domain);
  std::shared_ptr<Connection> make_connection(const EndPointAddress& remote,
                                              const ConnectionParameters& params,
                                              std::uint64_t listener_id, Domain& domain,
                                              Phase initial, std::shared_ptr<RecvBuffers> shared);

  void open_endpoint(Connection& conn, fi_info* info) const;

  [[nodiscard]] static EndpointCapabilities capabilities(const Connection& conn);

  // ---- sending ---------------------------------------------------------------------

  // Posts one message: `header` (copied into a registered slot) followed by `payload`.
  NetioStatus post_send(Connection& conn, std::span<const std::uint8_t> header,
                        std::span<const iovec> payload, std::span<void* const> payload_desc,
                        detail::PendingSend pending, std::size_t size);

  // ---- loop thread -------------------------------------------------------------------

  void assert_loop_thread() const noexcept { assert(m_loop->in_loop_thread()); }

  void on_kick();

  // The loop thread's view of m_domains, refreshed when a domain was added (domains are
  // only added until shutdown), so that polling rounds do not allocate. Walk it by index: a
  // callback inside a drain may open a connection and add a domain.
  const std::vector<Domain*>& loop_domains();

  void drain_all();

  // The prepare hook: true when every queue is empty and armed (fi_trywait), so the loop
  // may sleep on the wait fds; otherwise the queues are drained and the loop polls again.
  bool may_sleep();

  // A wait fd woke the loop and `handled` events were behind it.
  void on_wait_fd(Domain& domain, std::size_t handled);

  // After the event queue was read (by its fd, or by the prepare hook with nothing to
  // report): while the descriptor table is nearly full or exhausted, the queue is left out
  // of the loop for AcceptPauses::BACKOFF, logged once per episode, so that the tcp provider
  // stops accepting - it accepts on its own when the queue is read, and at the limit it spins
  // (tcpx_accept in 1.17 returns on EMFILE and leaves the connection in the backlog, so the
  // listening socket in the queue's wait set stays readable). True when it paused.
  bool pause_if_short_of_descriptors(Domain& domain);
  void resume_eq(Domain& domain);

  // Shutdown: reads what is left on `domain`'s event queue, refusing connection requests
  // (callbacks are off: nothing else is reported).
  void refuse_queued_requests(Domain& domain) noexcept;

  // Refuses a connection request without a reason: rejected through its listener's passive
  // endpoint while that is open (the client is told at once), else discarded.
  void refuse_request(Domain& domain, const Listener* listener, fi_info* request) noexcept;
  // A request no passive endpoint can answer any more (its listener was released): freed
  // through an endpoint closed at once; the client sees its connection end during the set-up.
  static void discard_request(Domain& domain, fi_info* request) noexcept;

  // Both drains return how many events or completions they handled.
  std::size_t drain_eq(Domain& domain);

  std::size_t drain_cq(Domain& domain);
  // Closes the connections whose peer shut down (Domain::peer_shutdowns): called once the
  // completion queue was read empty, so that everything they received was delivered.
  void close_shut_down_peers(Domain& domain);

  void on_completion(const Domain& domain, const fi_cq_data_entry& entry);

  void on_completion_error(Domain& domain, const fi_cq_err_entry& err);

  // A message arrived in op's buffer. Through a shared receive context `token` names its
  // connection (a tagged message, CM_TAG_DATA), 0 when the sender did not tag it.
  void on_received(Op& op, std::size_t len, std::uint64_t token = 0);

  // A heartbeat (an empty message with remote CQ data: the token), or a goodbye (one byte,
  // CM_GOODBYE), arrived into `op`.
  // A message with the untagged token as CQ data: a heartbeat (empty), a goodbye or an
  // acknowledgement (by its length).
  void on_control(Op& op, std::uint64_t token, std::size_t len);
  // The last message of an orderly close to a peer that takes one (CM_GOODBYE); under the
  // connection's mutex. Injected: nothing of ours for the provider to hold.
  static void say_goodbye(Connection& conn) noexcept;

  // Posts a connection's own receive buffer again (closes the connection if that fails).
  void repost(Op& op, Connection& conn);

  void repost_shared(Op& op);

  void on_send_done(Op& op, bool ok, const std::string& why);

  void on_cm_event(Domain& domain, std::uint32_t event, const fi_eq_cm_entry& entry,
                   std::span<const std::uint8_t> data);

  void on_eq_error(Domain& domain, const fi_eq_err_entry& err);

  // The server refused `old` because it has a connection from its source address and port:
  // a new endpoint, from a source port of its own, takes its place under the same address (at
  // most SOURCE_PORT_RETRIES times), and `old` goes without a callback. False when it may not
  // or could not; the caller then closes `old`.
  bool reconnect_from_new_source_port(const std::shared_ptr<Connection>& old);

  // A new endpoint takes `old`'s place under its address and connects with connect_data()
  // (another source port, or a keyed client's second request); `old` goes without a callback.
  // False when that failed (logged); the caller then closes `old`.
  bool connect_again(const std::shared_ptr<Connection>& old);

  // ---- admission (admission.hpp, docs/admission.md) -----------------------------------

  // Server: whether the request may be accepted; otherwise it was answered (a challenge, or a
  // refusal with the reason). `accept_tail` gets what the accept data carry behind the CmData.
  bool admit_request(const std::shared_ptr<Listener>& listener, fi_info* request,
                     const CmData& peer, std::span<const std::uint8_t> tail,
                     const EndPointAddress& remote, std::vector<std::uint8_t>& accept_tail);
  // Server: the accept hook's verdict on a request (true without a hook). It runs on the loop
  // thread, no lock held; a backend destroyed inside it refuses the request (m_deciding).
  bool decide(const std::shared_ptr<Listener>& listener, fi_info* request,
              const EndPointAddress& remote, std::string identity, bool key_proven);
  // Server: rejects a request with connection data of `flags` and `tail` (cut to what the
  // provider carries) through the listener's passive endpoint while that is open; otherwise
  // it is discarded (discard_request).
  void reject_request(const Listener& listener, fi_info* request, std::uint16_t flags,
                      std::span<const std::uint8_t> tail) noexcept;
  // Server: refuses a request as not admitted: logs `reason`, tells the client `for_client`.
  bool not_admitted(const Listener& listener, fi_info* request, const EndPointAddress& remote,
                    std::string_view reason, std::string_view for_client);
  // Client: the server's first answer was a challenge: ask again with the proof. False when
  // `conn` was refused instead.
  bool answer_challenge(const std::shared_ptr<Connection>& conn,
                        const std::optional<Challenge>& challenge);
  // Client: the accept data of a keyed connection prove the server's key; otherwise `conn` is
  // refused (NOT_ADMITTED) and false returned.
  bool server_proved(const std::shared_ptr<Connection>& conn, const CmData& peer,
                     std::span<const std::uint8_t> tail);

  // Closes the endpoint of a CLOSED connection and keeps the connection until the provider
  // holds none of its operations (release_retired).
  void retire(const std::shared_ptr<Connection>& conn);

  // retire() for a connection that never was registered (a failed or abandoned retry).
  void retire_unregistered(const std::shared_ptr<Connection>& conn);

  void on_connection_request(Domain& domain, const fi_eq_cm_entry& entry,
                             std::span<const std::uint8_t> data);

  void on_connected(const std::shared_ptr<Connection>& conn, std::span<const std::uint8_t> data);

  // ---- the transport (detail::TransportOf; post_buffer is with the API) -------------------
 public:
  // Closing: the endpoint goes (after a shutdown message to the peer of an open connection
  // that we close); the connection is kept until the provider is done with it (retire).
  void close_transport(const std::shared_ptr<Connection>& conn);

  // What the provider still holds (cancellations of posted operations) does not delay the
  // report: the ledger reports those sends as cancelled and ignores their completions.
  [[nodiscard]] static bool quiescent(const Connection& /*conn*/) { return true; }

  void close_listener(const std::shared_ptr<Listener>& listener);

  // Without callbacks (backend shutdown).
  static void abandon(Connection& conn) noexcept;

 private:
  void release_listener(Listener& listener);

  void release_retired(const Domain& domain);

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

  // Admission (loop thread): the key, the challenges a server waits answers for; and (under
  // m_pep_mutex) the request whose accept hook is running, which a listener released
  // meanwhile (any thread) answers before its passive endpoint goes.
  const detail::PartitionKey m_key{m_config.partition_key};
  ChallengeTable m_challenges;
  struct Deciding {
    std::shared_ptr<Listener> listener;
    fi_info* request;
    bool answered{false};
  };
  std::optional<Deciding> m_deciding;

  std::atomic<bool> m_kick_pending{false};
  // Lines about what peers send that names no connection: a flood writes a few a second.
  detail::LogLimiter m_peer_log;
  EventSignalHandle m_kick;
  PrepareHookHandle m_prepare;
};

#pragma GCC visibility pop

}  // namespace netio3::libfabric
