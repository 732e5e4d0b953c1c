#pragma once

// The connection engine: the lifecycle of a connection, written once for every transport
// (docs/architecture.md). A backend is
//
//   class Backend : public ConnectionEngine<Backend, Connection, Listener>,
//                   public std::enable_shared_from_this<Backend> { ... };
//
// and keeps only "how this transport moves bytes". The engine owns:
//  - the phases of a connection and how it ended (Phase, CloseCause, ConnectionBase);
//  - the endpoint registry with its index by id;
//  - the API's entry checks (thread model, address, parameters) and the calls that every
//    transport implements the same way: close_active_endpoint, close_listen_endpoint,
//    get_buffer, and send_buffer's bookkeeping;
//  - set-up deadlines (limits.connect_timeout);
//  - liveness (limits.peer_timeout): heartbeats to, and a deadline on silence from, every
//    open connection whose peer's protocol has them (common/liveness.hpp);
//  - the rule for reporting the end of a connection: from the loop thread, exactly once,
//    with every accepted send that did not complete among the cancelled keys, once the
//    transport holds nothing of the connection whose end must come first - and never
//    inside the API call that caused it (a close, a send or an open called on the loop
//    thread: the report is posted);
//  - the dispatch guard: every notification returns whether the caller may go on, false
//    once the application closed the connection or began destroying the backend in its
//    callback;
//  - the ready-to-send episodes (on_ready_to_send_cb): a refused send or an empty pool
//    begins one, a completion, a buffer back in the shared pool or the set-up ends it;
//  - delivery acknowledgement (DeliveryParameters): the replay window on the send calls,
//    the peer's counts ending sends (acknowledgement()), and this side's counts of what it
//    handed to on_data_cb, sent once per loop round through the transport's send_ack;
//  - loop-thread assertions (debug builds) and the destruction flag.
//
// What the transport implements is the concept TransportOf (common/engine_transport.hpp).
// This file declares the engine and defines its lifecycle (API calls, set-up, dispatch guard,
// closing, destruction); the members of one concern each are defined in engine_delivery.hpp
// (acknowledgement, replay window, drain), engine_ready.hpp (ready-to-send episodes),
// engine_sessions.hpp (sessions) and engine_statistics.hpp, included at the end.

#include <algorithm>
#include <atomic>
#include <cassert>
#include <concepts>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <sys/uio.h>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <netio3/event_loop.hpp>
#include <netio3/exceptions.hpp>
#include <netio3/network_buffer.hpp>
#include <netio3/statistics.hpp>
#include <netio3/types.hpp>

#include "common/buffer_pool.hpp"
#include "common/connection.hpp"
#include "common/endpoint_registry.hpp"
#include "common/endpoint_rules.hpp"
#include "common/engine_transport.hpp"
#include "common/liveness.hpp"
#include "common/log.hpp"
#include "common/notifier.hpp"
#include "common/send_ledger.hpp"
#include "common/setup_deadlines.hpp"
#include "common/thread_model.hpp"

namespace netio3::detail {

template <typename Derived, std::derived_from<ConnectionBase> Conn, RegisteredListener Listener>
class ConnectionEngine {
 public:
  using Registry = EndpointRegistry<Conn, Listener>;

  ConnectionEngine(std::string_view name, NetworkConfig config, std::shared_ptr<BaseEventLoop> loop,
                   ThreadSafetyModel model)
      : m_config{std::move(config)},
        m_loop{std::move(loop)},
        m_notifier{name, m_config},
        m_thread{model, *m_loop},
        m_registry{name, model == ThreadSafetyModel::SAFE},
        m_name{name} {}

  ConnectionEngine(const ConnectionEngine&) = delete;
  ConnectionEngine& operator=(const ConnectionEngine&) = delete;
  ConnectionEngine(ConnectionEngine&&) = delete;
  ConnectionEngine& operator=(ConnectionEngine&&) = delete;
  ~ConnectionEngine() = default;

  [[nodiscard]] const Notifier& notifier() const noexcept { return m_notifier; }

  // ---- API calls every transport implements the same way ------------------------------

  void close_active_endpoint(const EndPointAddress& address) {
    const ApiCall call{*this, "close_active_endpoint"};
    std::shared_ptr<Conn> conn;
    bool drain_first = false;
    {
      const auto held = m_registry.lock();
      // An open acknowledged connection drains first (once: a second close is at once).
      conn = m_registry.find(held, address);
      if (conn && conn->acknowledged_sends.load() && !conn->close_requested.load()) {
        bool open = false;
        {
          const std::lock_guard lock{conn->mutex};
          open = conn->phase == Phase::OPEN;
        }
        drain_first = open && !conn->draining.exchange(true);
      }
      if (!drain_first) conn = m_registry.take_for_close(held, address);
    }
    if (!drain_first) {
      close_requested(conn, "closed locally");
    } else if (m_loop->in_loop_thread()) {
      drain(conn);
    } else {
      std::weak_ptr<Derived> weak = derived().weak_from_this();
      m_loop->post([weak, conn] {
        if (auto self = weak.lock(); self && !self->shut_down()) self->drain(conn);
      });
    }
  }

  void close_listen_endpoint(const EndPointAddress& address) {
    const ApiCall call{*this, "close_listen_endpoint"};
    std::shared_ptr<Listener> listener;
    std::vector<std::shared_ptr<Conn>> children;
    {
      const auto held = m_registry.lock();
      std::tie(listener, children) = m_registry.take_listener(held, address);
    }
    derived().close_listener(listener);
    NETIO3_DEBUG("{}: stopped listening on {} ({} connection(s) to close)", m_name, address,
                 children.size());
    for (const auto& child : children) close_requested(child, "listen endpoint closed");
  }

  // Causes no callback: the thread-model check only (no ApiCall).
  NetworkBuffer* get_buffer(const EndPointAddress& address) {
    m_thread.check_caller("get_buffer");
    bool ended = false;
    const auto conn = m_registry.get(address, "get_buffer", &ended);
    if (ended) return nullptr;  // not reported yet: its sends are FAILED
    NetworkBuffer* buffer = acquire_send_buffer(*conn, m_name);
    if (buffer == nullptr && m_wants_ready) send_refused(conn, ConnectionBase::WAIT_BUFFER);
    return buffer;
  }

  NetioStatus send_buffer(const EndPointAddress& address, NetworkBuffer* buffer) {
    const ApiCall call{*this, "send_buffer"};
    const auto conn = m_registry.get(address, "send_buffer");
    BufferPool* pool = claim_send_buffer(*conn, buffer, m_name);
    if (pool == nullptr) return counted(conn, NetioStatus::FAILED);
    NetioStatus status = NetioStatus::FAILED;
    if (conn->draining.load(std::memory_order_relaxed)) [[unlikely]] {
      status = draining_failure(*conn);
    } else if (window_full(*conn, buffer->size())) {
      status = NetioStatus::NO_RESOURCES;
    } else {
      status = derived().post_buffer(conn, buffer);
    }
    if (status != NetioStatus::OK) pool->abort_send(buffer);
    return counted(conn, status);
  }

  NetioStatus send_data(const EndPointAddress& address, std::span<const iovec> iov,
                        std::span<const std::uint8_t> header, std::uint64_t key) {
    const ApiCall call{*this, "send_data"};
    const auto conn = m_registry.get(address, "send_data");
    if (!header_ok(address, header, m_name)) return counted(conn, NetioStatus::FAILED);
    if constexpr (requires(Conn & c) { std::span<const std::uint8_t>{c.region}; }) {
      if (!inside_zero_copy_region(*conn, iov)) return counted(conn, NetioStatus::FAILED);
    } else if (const auto& zc = conn->params.send_zero_copy_params; zc.mr_start != nullptr) {
      // A transport that can send from anywhere still holds the application to the region
      // it configured, so that code tested on it behaves the same on an RDMA backend.
      if (!inside_region(conn->remote, iov, {zc.mr_start, zc.buf_size}, m_name)) {
        return counted(conn, NetioStatus::FAILED);
      }
    }
    const std::uint64_t bytes = total_size(header, iov);
    if (conn->draining.load(std::memory_order_relaxed)) [[unlikely]] {
      return counted(conn, draining_failure(*conn));
    }
    if (window_full(*conn, bytes)) return counted(conn, NetioStatus::NO_RESOURCES);
    return counted(conn, derived().post_data(conn, header, iov, Payload::REFERENCE,
                                             PendingSend{key, nullptr, bytes}));
  }

  NetioStatus send_data_copy(const EndPointAddress& address, std::span<const iovec> iov,
                             std::span<const std::uint8_t> header, std::uint64_t key) {
    const ApiCall call{*this, "send_data_copy"};
    const auto conn = m_registry.get(address, "send_data_copy");
    if constexpr (requires { Derived::NO_COPY_SENDS; }) {
      throw NotSupported(
          fmt::format("{}: send_data_copy is not supported {}", m_name, Derived::NO_COPY_SENDS));
    }
    if (!header_ok(address, header, m_name)) return counted(conn, NetioStatus::FAILED);
    const std::uint64_t bytes = total_size(header, iov);
    if (conn->draining.load(std::memory_order_relaxed)) [[unlikely]] {
      return counted(conn, draining_failure(*conn));
    }
    if (window_full(*conn, bytes)) return counted(conn, NetioStatus::NO_RESOURCES);
    return counted(conn, derived().post_data(conn, header, iov, Payload::COPY,
                                             PendingSend{key, nullptr, bytes}));
  }

  // ---- statistics (any thread) -----------------------------------------------------------
  // Read under the connections' locks; with ThreadSafetyModel::UNSAFE those are off, and a
  // call from another thread is run on the loop, between two of its events.

  [[nodiscard]] ConnectionStatistics statistics(const EndPointAddress& address);

  [[nodiscard]] std::vector<ConnectionStatistics> connection_statistics();

  [[nodiscard]] BackendStatistics backend_statistics();

 protected:
  // An API call in progress: checks the caller against the thread model and, on the loop
  // thread, marks the loop as inside an API call, so that what the call causes is reported
  // after it has returned.
  class [[nodiscard]] ApiCall {
   public:
    ApiCall(ConnectionEngine& engine, std::string_view api) {
      engine.m_thread.check_caller(api);
      if (engine.m_loop->in_loop_thread()) {
        m_depth = &engine.m_api_depth;
        ++*m_depth;
      }
    }
    ApiCall(const ApiCall&) = delete;
    ApiCall& operator=(const ApiCall&) = delete;
    ApiCall(ApiCall&& other) noexcept : m_depth{std::exchange(other.m_depth, nullptr)} {}
    ApiCall& operator=(ApiCall&&) = delete;
    ~ApiCall() {
      if (m_depth != nullptr) --*m_depth;
    }

   private:
    int* m_depth{nullptr};
  };

  // open_listen_endpoint / open_active_endpoint: the checks before anything is opened.
  ApiCall open_call(const EndPointAddress& address, const ConnectionParameters& params,
                    bool listen) {
    const std::string_view api = listen ? "open_listen_endpoint" : "open_active_endpoint";
    ApiCall call{*this, api};
    check_address(address, api);
    check_connection_parameters(params, m_config, listen);
    if constexpr (!requires { Derived::SESSIONS; }) {
      if (params.delivery.session.enabled) {
        throw NotSupported(
            fmt::format("{}: {}: delivery.session: sessions are implemented on asyncmsg only (this "
                        "backend's connections can be acknowledged and drained, not resumed)",
                        m_name, api));
      }
    }
    return call;
  }

  // send_data's check for a transport that sends zero-copy from the connection's registered
  // region (Conn::region, under its mutex): false (logged) when a piece lies outside it.
  // Throws NotSupported without a region.
  bool inside_zero_copy_region(const Conn& conn, std::span<const iovec> iov) const requires
      requires(Conn& c) {
    std::span<const std::uint8_t>{c.region};
  }
  {
    std::span<const std::uint8_t> region;
    {
      const std::lock_guard lock{conn.mutex};
      region = conn.region;
    }
    if (region.empty()) {
      throw NotSupported(
          fmt::format("{}: send_data to {}: the endpoint was opened without a zero-copy region "
                      "(send_zero_copy_params.mr_start)",
                      m_name, conn.remote));
    }
    return inside_region(conn.remote, iov, region, m_name);
  }

  // A loop callback for an fd of `target` (a connection or listener): calls
  // (backend->*Handler)(target, events) while both are alive.
  template <auto Handler, typename Target>
  FdCallback fd_callback(const std::shared_ptr<Target>& target) {
    return [weak = derived().weak_from_this(),
            weak_target = std::weak_ptr<Target>{target}](std::uint32_t events) {
      auto self = weak.lock();
      auto t = weak_target.lock();
      if (self && t) ((*self).*Handler)(t, events);
    };
  }

  // ---- set-up ----------------------------------------------------------------------------

  // Called from Derived::start() (needs the shared owner).
  void start_engine() {
    static_assert(TransportOf<Derived, Conn, Listener>,
                  "the backend must implement the transport's half (TransportOf), publicly");
    std::weak_ptr<Derived> weak = derived().weak_from_this();
    m_setup.emplace(
        *m_loop, m_name, m_config.limits.connect_timeout,
        [](const Conn& conn) { return conn.setting_up(); },
        [weak](const std::shared_ptr<Conn>& conn, const std::string& reason) {
          if (auto self = weak.lock()) {
            self->refuse(conn, RefusalCause::TIMED_OUT, reason + " (limits.connect_timeout)");
          }
        });
    m_liveness.emplace(*m_loop, m_config.limits.peer_timeout, [weak] {
      if (auto self = weak.lock()) self->liveness_tick();
    });
    m_deadlines.emplace(*m_loop);
  }

  // `conn` must be open within limits.connect_timeout, or it is closed with the reason; returns
  // that deadline.
  std::chrono::steady_clock::time_point track_setup(const std::shared_ptr<Conn>& conn) {
    return m_setup->track(conn);
  }
  void track_setup(const std::shared_ptr<Conn>& conn, std::chrono::steady_clock::time_point until) {
    m_setup->track(conn, until);
  }

  std::uint64_t next_id() noexcept { return m_next_id.fetch_add(1, std::memory_order_relaxed); }

  // Whether a listener may accept a connection from `remote` (under the registry lock).
  enum class Admission { ACCEPT, LISTENER_CLOSED, SOURCE_PORT_COLLISION };
  Admission admission(const typename Registry::Lock& held, const Listener& listener,
                      const EndPointAddress& remote) {
    if (!m_registry.has_listener(held, listener.address)) return Admission::LISTENER_CLOSED;
    if (!m_registry.find(held, remote)) return Admission::ACCEPT;
    // docs/semantics.md: the refusal tells a netio3 client to connect from another port.
    NETIO3_WARN(
        "{}: refusing a connection on {} from {}: a connection from that address and port "
        "exists (a source-port collision: the client should connect from another port)",
        m_name, listener.address, remote);
    return Admission::SOURCE_PORT_COLLISION;
  }

  // The connection is set up: it is open from now on and the application hears of it. False
  // when the caller must not go on with it (closed by the application before or inside the
  // callback, or the backend is being destroyed).
  bool established(const std::shared_ptr<Conn>& conn, const EndpointCapabilities& caps) {
    assert_loop_thread();
    // Closed by the application during set-up: its posted close reports it (closed, no keys)
    // and it is never reported established.
    if (shut_down() || conn->close_requested.load() || conn->ending()) return false;
    {
      const std::lock_guard lock{conn->mutex};
      conn->phase = Phase::OPEN;
      conn->established_at = std::chrono::steady_clock::now();
    }
    if (conn->peer_sends_heartbeats || conn->peer_takes_heartbeats) m_liveness->watch(conn);
    // Sends refused while it was being set up: it takes them now. Read before the callback:
    // a refusal after it (another thread sending on the open connection) is a new episode
    // that its own resource ends.
    const bool refused_in_setup = conn->send_waits.load() != 0;
    m_notifier.established(conn->remote, caps);
    if (refused_in_setup && still_open(*conn)) {
      return ready_again(*conn);
    }
    return still_open(*conn);
  }

  // ---- the dispatch guard: notifications that say whether to go on ---------------------

  [[nodiscard]] bool still_open(const Conn& conn) const noexcept {
    return !shut_down() && conn.phase == Phase::OPEN &&
           !conn.close_requested.load(std::memory_order_relaxed);
  }

  // on_data_cb; false when the connection (or the backend) stopped in the callback.
  bool deliver(const Conn& conn, std::span<const std::uint8_t> bytes) {
    // Closed by the application, draining: what the peer sends is no longer handed over (nor
    // acknowledged: an acknowledged peer's close lists it).
    if (conn.draining.load(std::memory_order_relaxed)) [[unlikely]] {
      return still_open(conn);
    }
    // One writer (the loop thread): a load and a store, no locked instruction.
    auto& c = conn.counters;
    c.messages_received.store(c.messages_received.load(std::memory_order_relaxed) + 1,
                              std::memory_order_relaxed);
    c.bytes_received.store(c.bytes_received.load(std::memory_order_relaxed) + bytes.size(),
                           std::memory_order_relaxed);
    m_notifier.data(conn.remote, bytes);
    // Destroyed in the callback: `conn` may be gone with the backend.
    if (shut_down()) return false;
    if (conn.acks.peer_wants_acks) [[unlikely]] {
      delivered_one(conn, bytes.size());
    }
    return still_open(conn);
  }

  // The peer acknowledged that `count` of this side's messages were handed to its application
  // (cumulative): the sends that ends complete. False when the caller must not go on (the
  // connection closed: the count broke the protocol, or a callback closed it; the backend
  // is being destroyed). Loop thread.
  bool acknowledgement(const std::shared_ptr<Conn>& conn, std::uint64_t count);

  // on_send_completed_cb (the buffer of a buffered send is back in its pool); false when the
  // backend is being destroyed.
  bool completed(const Conn& conn, const PendingSend& send) {
    if (send.buffer != nullptr)
      conn.send_pool.load(std::memory_order_relaxed)->release(send.buffer);
    m_notifier.send_completed(conn.remote, send.key);
    if (shut_down()) return false;
    if (conn.draining.load(std::memory_order_relaxed)) [[unlikely]] {
      post_drain_check(conn);
    }
    if (!m_wants_ready) return true;
    // Read after the release and the ledger's completion (send_refused()'s other half).
    if (send.buffer != nullptr && m_buffer_waiters_exist.load(std::memory_order_relaxed)) {
      wake_buffer_waiters(conn.send_pool);
    }
    if ((conn.send_waits.load(std::memory_order_relaxed) & ConnectionBase::WAITING) != 0) {
      post_ready(conn);
    }
    return true;
  }

  // Ends `conn`'s ready-to-send episode, if one is on and it is open: on_ready_to_send_cb.
  // False when the backend is being destroyed. Loop thread.
  bool ready_again(const Conn& conn);

  // ---- closing -------------------------------------------------------------------------

  // Ends `conn`: it stops taking sends, leaves the registry, the transport begins closing
  // its side, and the end is reported once the transport is quiescent (finish()). Once
  // per connection; later calls are ignored. `report` false: the connection was replaced
  // under its address (a retry from a new source port) and the application never hears of
  // it. Loop thread.
  void close(const std::shared_ptr<Conn>& conn, std::string_view reason, CloseCause cause,
             bool report = true) {
    assert_loop_thread();
    if (shut_down()) {
      Derived::abandon(*conn);
      return;
    }
    if constexpr (requires { Derived::SESSIONS; }) {
      if (conn->session.enabled) [[unlikely]] {
        if (conn->session.farewell) report = false;
        if (interrupts(*conn, cause)) {
          interrupt(conn, reason, cause);
          return;
        }
        if (auto target = conn->session.resumes.lock()) {
          // A carrier that failed: the application never hears of it; the session tries again.
          conn->session.resumes.reset();
          close(conn, reason, cause, false);
          carrier_lost(std::static_pointer_cast<Conn>(target), conn, reason);
          return;
        }
        end_session(conn);
        // The application closed it while interrupted: the peer, which waits for a resume
        // until its give_up, is told (best effort: one attempt, within connect_timeout).
        if (cause == CloseCause::LOCAL && report && conn->session.down && conn->active() &&
            conn->phase == Phase::OPEN) {
          derived().say_farewell(conn);
        }
      }
    }
    // What the application was handed before it closed is acknowledged before the goodbye.
    if (cause == CloseCause::LOCAL && conn->phase == Phase::OPEN &&
        conn->acks.delivered != conn->acks.acked) {
      (void)send_ack(conn);  // no room: the peer's close lists them (docs/semantics.md)
      if (shut_down() || conn->ending()) return;
    }
    Phase previous{};
    {
      const std::lock_guard lock{conn->mutex};
      previous = conn->phase;
      if (previous >= Phase::CLOSING) return;
      conn->phase = Phase::CLOSING;
    }
    if (conn->draining.exchange(false)) conn->drain_timer.cancel();
    conn->ending_info = typename Conn::Ending{.cause = cause,
                                              .reason = std::string{reason},
                                              .was_open = previous == Phase::OPEN,
                                              .report = report};
    {
      // Before it leaves the registry: backend_statistics() always finds it somewhere.
      const std::lock_guard lock{m_ending_mutex};
      m_ending.emplace(conn->id, conn);  // kept until reported (or the backend goes)
    }
    {
      const auto held = m_registry.lock();
      // An open connection's sends are FAILED until its closed callback has returned.
      m_registry.remove(held, conn, previous == Phase::OPEN && report);
    }
    derived().close_transport(conn);
    finish(conn);
  }

  // ---- sessions (DeliveryParameters::Session; docs/sessions.md) -------------------------
  // The transport (Derived::SESSIONS) implements
  //  - detach_transport(conn, cause): the session connection is interrupted (`cause`: ERROR,
  //    the transport reported a failure; SILENT, the peer fell silent): drop its transport
  //    connection (no goodbye, nothing lingers), keep everything sent for a resume;
  //  - resume_transport(conn): active side, an attempt: start a carrier (a new transport
  //    connection set up like any other, session.resumes naming `conn`) and return it, or
  //    nullptr (logged) when it could not start;
  //  - say_farewell(conn): active side, the application closed `conn` while interrupted:
  //    start a carrier (session.farewell) that tells the peer the session ended.

  // A new session's id (the active side's, at its first connect).
  static ConnectionBase::SessionId new_session_id();

  // Whether a close for `cause` interrupts a session connection rather than ending it: the
  // transport broke (an error, a silent peer, an end without goodbye) on an open connection
  // that the application is not closing - also while a close drains (the drain's timeout
  // bounds it).
  [[nodiscard]] static bool interrupts(const Conn& conn, CloseCause cause) noexcept;

  void interrupt(const std::shared_ptr<Conn>& conn, std::string_view reason, CloseCause cause);
  // The listening side keeps at most limits.max_interrupted_sessions interrupted sessions.
  void keep_interrupted_within_limit();

  // Active side: the next attempt after the back-off (first_delay, doubling to max_delay, each
  // with jitter: a delay between half and all of it).
  void schedule_attempt(const std::shared_ptr<Conn>& conn);

  std::shared_ptr<ConnectionBase> resume_transport(const std::shared_ptr<Conn>& conn);

  // A carrier failed before it resumed `target`.
  void carrier_lost(const std::shared_ptr<Conn>& target, const std::shared_ptr<Conn>& carrier,
                    std::string_view reason);

  // The session cannot be resumed: the connection ends for good (its closed callback lists
  // what was not acknowledged).
  void give_up(const std::shared_ptr<Conn>& conn, std::string_view why = {});

  // The session's timers and any attempt in progress end with the connection.
  void end_session(const std::shared_ptr<Conn>& conn);

  // The transport carries the session again (the new transport connection is attached, what
  // the peer had not delivered of this side's sends is being sent again); the peer had
  // handed `peer_delivered` of them to its application. False when the caller must not go on.
  bool resumed(const std::shared_ptr<Conn>& conn, std::uint64_t peer_delivered);

  // The peer of an open connection sent what its protocol does not allow: logged, and closed
  // with "protocol error: <what>". Returns false (the caller stops). Loop thread.
  bool protocol_violation(const std::shared_ptr<Conn>& conn, std::string_view what) {
    const auto reason = fmt::format("protocol error: {}", what);
    NETIO3_WARN("{}: closing connection with {}: {}", m_name, conn->remote, reason);
    close(conn, reason, CloseCause::PROTOCOL);
    return false;
  }

  // close() for an error that, during the set-up of an active connection, is reported to the
  // application as a refusal for `refusal` (on_connection_refused_reason_cb). Loop thread.
  // `cause` says what an open connection's end was (the peer broke the protocol, ...).
  void refuse(const std::shared_ptr<Conn>& conn, RefusalCause refusal, std::string_view reason,
              CloseCause cause = CloseCause::ERROR) {
    assert_loop_thread();
    if (conn->setting_up()) conn->refusal = refusal;
    close(conn, reason, cause);
  }

  // close() from any thread: posted to the loop.
  void close_later(const std::shared_ptr<Conn>& conn, std::string reason, CloseCause cause) {
    std::weak_ptr<Derived> weak = derived().weak_from_this();
    m_loop->post([weak, conn, reason = std::move(reason), cause] {
      if (auto self = weak.lock()) self->close(conn, reason, cause);
    });
  }

  // refuse() from any thread: posted to the loop.
  void refuse_later(const std::shared_ptr<Conn>& conn, RefusalCause refusal, std::string reason) {
    std::weak_ptr<Derived> weak = derived().weak_from_this();
    m_loop->post([weak, conn, refusal, reason = std::move(reason)] {
      if (auto self = weak.lock()) self->refuse(conn, refusal, reason);
    });
  }

  // The application closed `conn` (or its listener): at once on the loop thread (it is
  // inside the API call, so the report is posted), else posted.
  void close_requested(const std::shared_ptr<Conn>& conn, std::string_view reason) {
    if (m_loop->in_loop_thread()) {
      close(conn, reason, CloseCause::LOCAL);
    } else {
      close_later(conn, std::string{reason}, CloseCause::LOCAL);
    }
  }

  // The transport's holdings of a CLOSING connection changed: once it is quiescent, the
  // connection is CLOSED, every send still open is cancelled and the end is reported.
  // Returns false when the caller must not go on (the backend is being destroyed).
  bool finish(const std::shared_ptr<Conn>& conn) {
    if (shut_down()) return false;
    if (conn->phase != Phase::CLOSING || !std::as_const(derived()).quiescent(*conn)) return true;
    std::vector<std::uint64_t> keys;
    {
      const std::lock_guard lock{conn->mutex};
      conn->phase = Phase::CLOSED;
      keys = cancel_all_sends(conn->ledger, conn->send_pool);
    }
    {
      const auto ended = snapshot(*conn);
      const std::lock_guard lock{m_ending_mutex};
      add_counts(m_ended, ended);
      if (conn->ending_info.report) ++m_ended.connections_closed;  // not: replaced (a retry)
      m_ending.erase(conn->id);
    }
    if constexpr (requires { derived().after_closed(conn); }) derived().after_closed(conn);
    // Its cancelled buffered sends went back to a shared pool that others may wait on.
    if (m_buffer_waiters_exist.load(std::memory_order_relaxed) && conn->send_pool != nullptr &&
        conn->send_pool != conn->own_send_pool.get()) {
      post_buffer_wake(conn->send_pool);
    }
    if (!conn->ending_info.report) {
      forget_reported(conn);
      return true;
    }
    if (m_api_depth > 0) {
      // Caused by an API call on the loop thread: reported after it has returned.
      std::weak_ptr<Derived> weak = derived().weak_from_this();
      m_loop->post([weak, conn, keys = std::move(keys)] {
        auto self = weak.lock();
        if (self && !self->shut_down()) self->report_end(conn, keys);
      });
      return true;
    }
    report_end(conn, keys);
    return !shut_down();
  }

  // ---- destruction ---------------------------------------------------------------------

  // Begins destroying the backend: false if that had begun. From now on no callback runs,
  // close() abandons, and set-up deadlines expire no more.
  bool begin_shutdown() noexcept {
    if (m_shut_down.exchange(true)) return false;
    if (m_setup) m_setup->close();
    if (m_liveness) m_liveness->close();
    if (m_deadlines) m_deadlines->close();
    m_ack_hook.close();
    m_acks_due.clear();
    return true;
  }
  [[nodiscard]] bool shut_down() const noexcept {
    return m_shut_down.load(std::memory_order_acquire);
  }

  // Everything the backend has (for its shutdown, after begin_shutdown()): listeners, and
  // connections open, in set-up, or closing and not yet reported. The registry is empty
  // afterwards; its index is left for the transport (clear_index()).
  struct Everything {
    std::vector<std::shared_ptr<Listener>> listeners;
    std::vector<std::shared_ptr<Conn>> connections;
  };
  [[nodiscard]] Everything take_everything() {
    Everything all;
    {
      const auto held = m_registry.lock();
      auto contents = m_registry.take_all(held);
      all.listeners = std::move(contents.listeners);
      all.connections = std::move(contents.connections);
    }
    const std::lock_guard lock{m_ending_mutex};
    for (auto& [id, conn] : m_ending) all.connections.push_back(std::move(conn));
    m_ending.clear();
    return all;
  }

  void assert_loop_thread() const noexcept { assert(m_loop->in_loop_thread()); }

  const NetworkConfig m_config;
  const std::shared_ptr<BaseEventLoop> m_loop;
  const Notifier m_notifier;
  const ThreadModel m_thread;
  Registry m_registry;

 private:
  Derived& derived() noexcept { return static_cast<Derived&>(*this); }
  const Derived& derived() const noexcept { return static_cast<const Derived&>(*this); }

  // f() on the loop thread, its result here (exceptions too).
  template <typename F>
  auto on_loop(F&& f) {
    std::invoke_result_t<F> out{};
    m_loop->run_sync([&] { out = f(); });
    return out;
  }

  // Counts a send call's result on the connection's statistics; a refusal begins (or
  // continues) a ready-to-send episode.
  NetioStatus counted(const std::shared_ptr<Conn>& conn, NetioStatus status) {
    if (status == NetioStatus::OK) [[likely]] {
      return status;
    }
    if (status == NetioStatus::NO_RESOURCES) {
      conn->counters.no_resources.fetch_add(1, std::memory_order_relaxed);
      if (m_wants_ready) send_refused(conn, ConnectionBase::WAIT_TRANSPORT);
    } else {
      conn->counters.failed.fetch_add(1, std::memory_order_relaxed);
    }
    return status;
  }

  // The owner of a connection the engine was handed by reference (to keep or pass on).
  static std::shared_ptr<Conn> owner(const Conn& conn) {
    return std::const_pointer_cast<Conn>(
        std::static_pointer_cast<const Conn>(conn.shared_from_this()));
  }

  // ---- the drain of close_active_endpoint on an acknowledged connection ----------------

  NetioStatus draining_failure(const Conn& conn) const;

  [[nodiscard]] static bool drained(const Conn& conn);

  // Loop thread: closes `conn` once what it sent is acknowledged, or at the drain timeout.
  void drain(const std::shared_ptr<Conn>& conn);

  // A completion on a draining connection: once the batch it came in was reported, see whether
  // that was the last.
  void post_drain_check(const Conn& conn);

  void end_drain(const std::shared_ptr<Conn>& conn, std::string_view reason);

  // An acknowledged connection holds what it sent until the peer acknowledges it: a send
  // of `bytes` past its replay window is refused (NO_RESOURCES; the acknowledgements'
  // completions end the episode). Any thread. Racing sends may each pass: the window is
  // exceeded by at most one message per sending thread.
  bool window_full(const Conn& conn, std::uint64_t bytes) const;

  // A message was handed to on_data_cb on a connection whose peer wants acknowledgements:
  // counted, and an acknowledgement is due at the end of this round of the loop (one per
  // connection per round, carrying the latest count). Loop thread.
  void delivered_one(const Conn& conn, std::size_t size);

  // The prepare hook: the acknowledgements due this round.
  void send_due_acks();

  // False when the transport had no room for it.
  bool send_ack(const std::shared_ptr<Conn>& conn);

  // Handed over since the last acknowledgement, beyond which one goes at once rather than at
  // the end of the loop's round (a sender of large messages waits on it for its buffers).
  static constexpr std::uint64_t ACK_AT_ONCE_BYTES = std::uint64_t{256} << 10U;

  // A send was refused for `cause` (any thread): the episode waits on it. The refusal and
  // what ends the episode can race (the last completion may come just before the flag is
  // set): after setting it, this looks again, under the locks the loop completes under, at
  // whether an end will still come; if none will because the resource is free already,
  // the episode is ended from the loop now. Where a wake-up comes from:
  //  - WAIT_TRANSPORT (window, queue, still connecting): a completion on this connection,
  //    or established(); none if nothing is in flight, so that is ended now;
  //  - WAIT_BUFFER (pool empty): a buffer back in the pool - this connection's completions,
  //    or, for a shared pool, any connection's (the waiter list).
  void send_refused(const std::shared_ptr<Conn>& conn, ConnectionBase::SendWait cause);

  // ready_again(conn) from the loop, after the event being handled (any thread; at most
  // one on its way per connection). Never at once: a sender that sends from the callback
  // and whose sends complete at once (UCX) would otherwise never leave the transport's
  // completion handling; and the completions of one batch end one episode, not one each.
  void post_ready(const Conn& conn);

  // A buffer came back to the shared pool `pool`: ends (posted) the episodes of the
  // connections waiting for one of its buffers. Loop thread.
  void wake_buffer_waiters(const BufferPool* pool);

  void post_buffer_wake(const BufferPool* pool);

  static std::uint64_t total_size(std::span<const std::uint8_t> header,
                                  std::span<const iovec> iov) noexcept {
    std::uint64_t size = header.size();
    for (const auto& v : iov) size += v.iov_len;
    return size;
  }

  // A connection's statistics now (its lock for a moment).
  ConnectionStatistics snapshot(const Conn& conn) const;

  static void add_counts(BackendStatistics& total, const ConnectionStatistics& s) noexcept;

  // Heartbeats to every open connection whose peer takes them, and the end of those whose
  // peer fell silent (common/liveness.hpp). From the liveness timer.
  void liveness_tick() {
    if (shut_down()) return;
    const auto receiving = [this](const Conn& conn) {
      if constexpr (requires { std::as_const(derived()).receiving(conn); }) {
        return std::as_const(derived()).receiving(conn);
      } else {
        (void)this;  // only the backends that can stop reading use it
        return true;
      }
    };
    const auto sweep = m_liveness->sweep(receiving);
    for (const auto& conn : sweep.beat) {
      derived().send_heartbeat(conn);
      if (shut_down()) return;
    }
    for (const auto& conn : sweep.silent) {
      const auto reason = fmt::format(
          "nothing arrived from the peer for {} ms (limits.peer_timeout): the peer, its host or "
          "the link is gone",
          m_liveness->timeout().count());
      NETIO3_WARN("{}: closing connection with {}: {}", m_name, conn->remote, reason);
      close(conn, reason, CloseCause::SILENT);
      if (shut_down()) return;
    }
  }

  // Sends to the address of a connection that ended by itself are FAILED until its end is
  // reported, and throw UnknownActiveEndpoint afterwards (EndpointRegistry::get()).
  void forget_reported(const std::shared_ptr<Conn>& conn) {
    const auto held = m_registry.lock();
    m_registry.reported(held, conn);
  }

  // The one callback that applies (docs/semantics.md):
  //  - it had been open: on_connection_closed_cb with the cancelled keys;
  //  - an active endpoint never open: on_connection_closed_cb (no keys) when the application
  //    closed it, on_connection_refused_cb otherwise;
  //  - an accepted connection never open: no callback, a debug line.
  void report_end(const std::shared_ptr<Conn>& ended, const std::vector<std::uint64_t>& keys) {
    const Conn& conn = *ended;
    const auto& info = conn.ending_info;
    if (info.was_open || (conn.active() && info.cause == CloseCause::LOCAL)) {
      m_notifier.closed(conn.remote, keys,
                        CloseReason{.cause = public_cause(info.cause), .message = info.reason});
    } else if (conn.active()) {
      m_notifier.refused(conn.remote, conn.refusal, info.reason);
    } else {
      NETIO3_DEBUG("{}: dropped incoming connection from {} before it was established: {}", m_name,
                   conn.remote, info.reason);
    }
    // Inside the callback a send still reads FAILED; after it, the address is unknown.
    if (!shut_down()) forget_reported(ended);
  }

  std::string_view m_name;
  const bool m_wants_ready{m_notifier.wants_ready_to_send()};
  std::atomic<bool> m_shut_down{false};
  std::atomic<std::uint64_t> m_next_id{1};
  std::optional<SetupDeadlines<Conn>> m_setup;  // set in start_engine()
  std::optional<Liveness<Conn>> m_liveness;     // set in start_engine()
  // Drains' and sessions' deadlines, on one timer descriptor; set in start_engine().
  std::optional<Deadlines> m_deadlines;
  // Connections owing their peer an acknowledgement this round (delivered_one()), and the
  // hook that sends them (added at the first). Loop thread only.
  PrepareHookHandle m_ack_hook;
  std::vector<std::shared_ptr<Conn>> m_acks_due;
  std::vector<std::shared_ptr<Conn>> m_acks_sending;
  // Loop thread only.
  int m_api_depth{0};  // API calls in progress
  // CLOSING, by id (written on the loop thread), and the counts of those that ended.
  mutable std::mutex m_ending_mutex;
  std::unordered_map<std::uint64_t, std::shared_ptr<Conn>> m_ending;
  BackendStatistics m_ended;
  // Connections waiting for a buffer of a shared send pool (send_refused()).
  std::mutex m_buffer_waiters_mutex;
  std::vector<std::weak_ptr<Conn>> m_buffer_waiters;
  std::atomic<bool> m_buffer_waiters_exist{false};
};

}  // namespace netio3::detail

// The members defined apart, one concern each.
#include "common/engine_delivery.hpp"    // IWYU pragma: export
#include "common/engine_ready.hpp"       // IWYU pragma: export
#include "common/engine_sessions.hpp"    // IWYU pragma: export
#include "common/engine_statistics.hpp"  // IWYU pragma: export
