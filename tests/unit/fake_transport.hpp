#pragma once

// FakeTransport: the connection engine (src/common/connection_engine.hpp) over an in-memory
// "network" that the test drives by hand. It is a complete NetworkBackend (through the same
// BackendFacade as the real ones), so tests use the public API and the user callbacks; and
// the test decides when a connection is made, set up, when a send completes, when data
// arrives, when the peer closes or the transport fails - the orders that real transports
// produce only by chance.
//
// The fake's transport: a send is accepted into the connection's flight (at most WINDOW, else
// NO_RESOURCES; buffered sends from the connection's own pool or the shared one) and
// completes when the test says so; a graceful close (local or peer, of an
// open connection) waits for the flight to complete; an error close drops it (its sends end
// as cancelled).

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <sys/uio.h>
#include <vector>

#include "common/backend_facade.hpp"
#include "common/connection.hpp"
#include "common/connection_engine.hpp"

namespace netio3::test {

struct FakeListener {
  std::uint64_t id;
  EndPointAddress address;
  ConnectionParameters params;
  bool closed{false};
};

struct FakeConnection : detail::ConnectionBase {
  using ConnectionBase::ConnectionBase;
  // Under `mutex`: the accepted sends, in order, not yet completed.
  std::deque<detail::SendLedger::Ticket> flight;
  // Loop thread.
  bool transport_closed{false};
  bool graceful{false};
  bool abandoned{false};
  int heartbeats_sent{0};
  std::vector<std::uint64_t> acks_sent;  // send_ack's counts
  bool reading{true};                    // receiving(): false pauses the peer-timeout judgement
};

class FakeTransport : public detail::ConnectionEngine<FakeTransport, FakeConnection, FakeListener>,
                      public std::enable_shared_from_this<FakeTransport> {
 public:
  static constexpr BackendType TYPE = BackendType::ASYNCMSG;
  static constexpr std::size_t WINDOW = 8;
  using Engine = detail::ConnectionEngine<FakeTransport, FakeConnection, FakeListener>;

  FakeTransport(NetworkConfig config, std::shared_ptr<BaseEventLoop> loop)
      : Engine{"fake", config, std::move(loop), config.thread_safety} {
    const auto& shared = config.shared_send_buffers;
    if (shared.use_shared_send_buffers) {
      m_shared_send_pool =
          std::make_unique<detail::BufferPool>(shared.num_buf, shared.buf_size, 0, m_thread.safe());
    }
  }

  // The fake of the backend made last (set by start(), on the constructing thread).
  static std::shared_ptr<FakeTransport> latest() {
    const std::lock_guard lock{latest_mutex()};
    return latest_ref().lock();
  }

  void start() {
    start_engine();
    const std::lock_guard lock{latest_mutex()};
    latest_ref() = weak_from_this();
  }

  void shutdown() noexcept {
    if (!begin_shutdown()) return;
    const auto all = take_everything();
    for (const auto& conn : all.connections) abandon(*conn);
    m_registry.clear_index();
  }

  // The backend's destruction has begun.
  [[nodiscard]] bool destroyed() const noexcept { return shut_down(); }

  // ---- API -------------------------------------------------------------------------------

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                       const ConnectionParameters& params) {
    const ApiCall call = open_call(address, params, true);
    EndPointAddress actual = address;
    if (actual.port == 0) actual.port = static_cast<std::uint16_t>(40000 + next_id());
    auto listener = std::make_shared<FakeListener>(FakeListener{next_id(), actual, params});
    {
      const std::lock_guard lock{m_all_mutex};
      m_listeners.push_back(listener);
    }
    const auto held = m_registry.lock();
    m_registry.add_listener(held, actual, listener);
    m_registry.index(listener);
    return actual;
  }

  void open_active_endpoint(const EndPointAddress& address, const ConnectionParameters& params) {
    const ApiCall call = open_call(address, params, false);
    auto conn = std::make_shared<FakeConnection>(next_id(), address, params, 0, m_thread.safe(),
                                                 detail::Phase::CONNECTING);
    detail::attach_send_pool(*conn, m_shared_send_pool.get(), 0, m_thread.safe());
    {
      const auto held = m_registry.lock();
      m_registry.check_connection_free(held, address);
      m_registry.add_connection(held, conn);
      m_registry.index(conn);
    }
    remember(conn);
    track_setup(conn);
  }

  // ---- the transport (TransportOf) -----------------------------------------------------

  NetioStatus post_buffer(const std::shared_ptr<FakeConnection>& conn, NetworkBuffer* buffer) {
    return post(conn, detail::PendingSend{buffer->id(), buffer});
  }

  NetioStatus post_data(const std::shared_ptr<FakeConnection>& conn,
                        std::span<const std::uint8_t> /*header*/, std::span<const iovec> /*iov*/,
                        detail::Payload /*payload*/, detail::PendingSend pending) {
    return post(conn, pending);
  }

  void close_transport(const std::shared_ptr<FakeConnection>& conn) {
    conn->transport_closed = true;
    const auto cause = conn->ending_info.cause;
    conn->graceful = conn->ending_info.was_open &&
                     (cause == detail::CloseCause::LOCAL || cause == detail::CloseCause::PEER);
    if (!conn->graceful) {
      const std::lock_guard lock{conn->mutex};
      conn->flight.clear();  // dropped: cancelled at the report
    }
  }

  [[nodiscard]] bool quiescent(const FakeConnection& conn) const {
    const std::lock_guard lock{conn.mutex};
    return conn.flight.empty();
  }

  static void abandon(FakeConnection& conn) noexcept {
    conn.abandoned = true;
    const std::lock_guard lock{conn.mutex};
    conn.phase = detail::Phase::CLOSED;
    conn.flight.clear();
    conn.ledger.cancel_all();
  }

  void close_listener(const std::shared_ptr<FakeListener>& listener) { listener->closed = true; }

  void send_heartbeat(const std::shared_ptr<FakeConnection>& conn) { ++conn->heartbeats_sent; }
  bool send_ack(const std::shared_ptr<FakeConnection>& conn, std::uint64_t count) {
    conn->acks_sent.push_back(count);
    return true;
  }

  [[nodiscard]] static bool receiving(const FakeConnection& conn) { return conn.reading; }

  // ---- the fake network (the test calls these on the loop thread) ----------------------

  // The latest connection with `remote` (also while it is closing); null if none.
  std::shared_ptr<FakeConnection> find(const EndPointAddress& remote) {
    const std::lock_guard lock{m_all_mutex};
    for (auto it = m_all.rbegin(); it != m_all.rend(); ++it) {
      if ((*it)->remote == remote) return *it;
    }
    return nullptr;
  }

  // The transport's connection is made: set-up goes on.
  void connected(const std::shared_ptr<FakeConnection>& conn) {
    const std::lock_guard lock{conn->mutex};
    if (conn->phase == detail::Phase::CONNECTING) conn->phase = detail::Phase::HANDSHAKE;
  }

  // Set-up is done; false when the caller must not go on. `heartbeats`: the peer's protocol
  // sends and takes heartbeats.
  bool establish(const std::shared_ptr<FakeConnection>& conn, bool heartbeats = false) {
    conn->peer_sends_heartbeats = heartbeats;
    conn->peer_takes_heartbeats = heartbeats;
    return established(conn, EndpointCapabilities{.send_buffered = conn->send_pool != nullptr,
                                                  .send_copy = true,
                                                  .send_zero_copy = true,
                                                  .receive = true});
  }

  // A peer connects to `listener` from `remote`; null if refused (listener gone, collision).
  std::shared_ptr<FakeConnection> accept(const EndPointAddress& listener,
                                         const EndPointAddress& remote) {
    std::shared_ptr<FakeConnection> conn;
    {
      const auto held = m_registry.lock();
      if (!m_registry.has_listener(held, listener)) return nullptr;
      std::shared_ptr<FakeListener> owner;
      {
        const std::lock_guard lock{m_all_mutex};
        for (const auto& l : m_listeners) {
          if (l->address == listener && !l->closed) owner = l;
        }
      }
      if (!owner || admission(held, *owner, remote) != Admission::ACCEPT) return nullptr;
      conn = std::make_shared<FakeConnection>(next_id(), remote, owner->params, owner->id,
                                              m_thread.safe(), detail::Phase::HANDSHAKE);
      detail::attach_send_pool(*conn, m_shared_send_pool.get(), 0, m_thread.safe());
      m_registry.add_connection(held, conn);
      m_registry.index(conn);
    }
    remember(conn);
    track_setup(conn);
    return conn;
  }

  // The oldest send in flight completes; false when there was none, or the caller must not
  // go on.
  bool complete_one(const std::shared_ptr<FakeConnection>& conn) {
    detail::PendingSend done;
    bool reported = false;
    {
      const std::lock_guard lock{conn->mutex};
      if (conn->flight.empty()) return false;
      reported = conn->ledger.complete(conn->flight.front(), done);
      conn->flight.pop_front();
    }
    if (reported && !completed(*conn, done)) return false;
    return finish(conn);
  }

  // A message arrives; false when the caller must not go on.
  bool receive(const std::shared_ptr<FakeConnection>& conn, std::span<const std::uint8_t> bytes) {
    if (!still_open(*conn)) return false;
    return deliver(*conn, bytes);
  }

  // The peer acknowledges `count` of this side's messages; false when the caller must not go
  // on.
  bool peer_acknowledges(const std::shared_ptr<FakeConnection>& conn, std::uint64_t count) {
    return acknowledgement(conn, count);
  }

  // The next send is refused (NO_RESOURCES) whatever is in flight.
  void refuse_next() { m_refuse_next = true; }

  void peer_closes(const std::shared_ptr<FakeConnection>& conn) {
    close(conn, "peer closed the connection", detail::CloseCause::PEER);
  }
  void fails(const std::shared_ptr<FakeConnection>& conn, std::string_view why) {
    close(conn, why, detail::CloseCause::ERROR);
  }

 private:
  static std::mutex& latest_mutex() {
    static std::mutex mutex;
    return mutex;
  }
  static std::weak_ptr<FakeTransport>& latest_ref() {
    static std::weak_ptr<FakeTransport> latest;
    return latest;
  }

  void remember(const std::shared_ptr<FakeConnection>& conn) {
    const std::lock_guard lock{m_all_mutex};
    m_all.push_back(conn);
  }

  NetioStatus post(const std::shared_ptr<FakeConnection>& conn, detail::PendingSend send) {
    const std::lock_guard lock{conn->mutex};
    if (conn->close_requested.load() || conn->ending()) return NetioStatus::FAILED;
    if (conn->setting_up() || conn->flight.size() >= WINDOW || m_refuse_next.exchange(false)) {
      return NetioStatus::NO_RESOURCES;
    }
    conn->flight.push_back(conn->ledger.add(send));
    return NetioStatus::OK;
  }

  std::unique_ptr<detail::BufferPool> m_shared_send_pool;  // shared_send_buffers
  std::atomic<bool> m_refuse_next{false};
  std::mutex m_all_mutex;
  std::vector<std::shared_ptr<FakeConnection>> m_all;
  std::vector<std::shared_ptr<FakeListener>> m_listeners;
};

}  // namespace netio3::test
