#pragma once

// The endpoint tables every backend keeps: listeners by the address they listen on,
// connections by their remote address, and connections the application closed whose close
// the loop has not finished yet. The same checks and exceptions for every transport.
//
// The registry owns its mutex. Every member takes a `Lock` as proof that the caller holds
// it, so a backend can compose "check, create, register, insert" into one critical
// section (a readiness event may be dispatched before that sequence returns).
//
// Beside the tables, an index by id: the transports' completions and events name a
// connection or listener by the id they were given when posted.
//
// The index has a mutex of its own, taken last and alone: transports look connections up by
// id from inside their progress calls (UCX: under its worker's lock), while the tables' lock
// is held across the creation of a connection. Both are off for ThreadSafetyModel::UNSAFE
// (every call comes from the loop thread).

#include <concepts>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <netio3/exceptions.hpp>
#include <netio3/types.hpp>

#include "common/endpoint_rules.hpp"
#include "common/thread_model.hpp"

namespace netio3::detail {

// What the registry needs of a connection and of a listener.
template <typename Conn>
concept RegisteredConnection = requires(Conn& c) {
  { c.id } -> std::convertible_to<std::uint64_t>;
  { c.remote } -> std::convertible_to<EndPointAddress>;
  { c.listener_id } -> std::convertible_to<std::uint64_t>;  // 0: an active endpoint
  c.close_requested.store(true);
};
template <typename Listener>
concept RegisteredListener = requires(Listener& l) {
  { l.id } -> std::convertible_to<std::uint64_t>;  // > 0
  { l.address } -> std::convertible_to<EndPointAddress>;
};

template <RegisteredConnection Conn, RegisteredListener Listener>
class EndpointRegistry {
 public:
  using Lock = std::unique_lock<OptionalMutex>;

  EndpointRegistry(std::string_view backend, bool thread_safe)
      : m_backend{backend}, m_mutex{thread_safe}, m_index_mutex{thread_safe} {}

  [[nodiscard]] Lock lock() { return Lock{m_mutex}; }

  // ---- the index by id (connections from creation until forget(), listeners until
  // forget_listener()) ------------------------------------------------------------------

  void index(const std::shared_ptr<Listener>& listener) {
    const std::lock_guard lock{m_index_mutex};
    m_listeners_by_id.emplace(listener->id, listener);
  }
  void index(const std::shared_ptr<Conn>& conn) {
    const std::lock_guard lock{m_index_mutex};
    m_by_id.emplace(conn->id, conn);
  }
  void forget(std::uint64_t id) {
    const std::lock_guard lock{m_index_mutex};
    m_by_id.erase(id);
  }
  void forget_listener(std::uint64_t id) {
    const std::lock_guard lock{m_index_mutex};
    m_listeners_by_id.erase(id);
  }
  // Another id that finds `conn` (a resumed session's new token on the wire, while its own id
  // stays indexed), until forget_alias(); an id in use already is not taken.
  bool alias(std::uint64_t id, const std::shared_ptr<Conn>& conn) {
    const std::lock_guard lock{m_index_mutex};
    if (m_by_id.contains(id)) return false;
    return m_aliases.emplace(id, conn).second;
  }
  void forget_alias(std::uint64_t id) {
    const std::lock_guard lock{m_index_mutex};
    m_aliases.erase(id);
  }
  [[nodiscard]] std::shared_ptr<Conn> by_id(std::uint64_t id) {
    const std::lock_guard lock{m_index_mutex};
    if (const auto it = m_by_id.find(id); it != m_by_id.end()) return it->second.lock();
    const auto it = m_aliases.find(id);
    return it == m_aliases.end() ? nullptr : it->second.lock();
  }
  [[nodiscard]] bool id_in_use(const Lock& /*held*/, std::uint64_t id) {
    const std::lock_guard lock{m_index_mutex};
    return m_by_id.contains(id) || m_aliases.contains(id);
  }
  [[nodiscard]] std::shared_ptr<Listener> listener_by_id(std::uint64_t id) {
    const std::lock_guard lock{m_index_mutex};
    const auto it = m_listeners_by_id.find(id);
    return it == m_listeners_by_id.end() ? nullptr : it->second.lock();
  }
  // Every indexed connection still alive (backend shutdown; aliases name them again).
  [[nodiscard]] std::vector<std::shared_ptr<Conn>> indexed() {
    const std::lock_guard lock{m_index_mutex};
    std::vector<std::shared_ptr<Conn>> all;
    for (const auto& [id, weak] : m_by_id) {
      if (auto conn = weak.lock()) all.push_back(std::move(conn));
    }
    return all;
  }

  // ---- listeners -----------------------------------------------------------------------

  // Throws ListenEndpointAlreadyExists if `address` (with a fixed port) is in use.
  void check_listen_free(const Lock& /*held*/, const EndPointAddress& address) const {
    if (m_listeners.contains(address)) {
      throw ListenEndpointAlreadyExists(
          fmt::format("{}: already listening on {}", m_backend, address));
    }
  }

  void add_listener(const Lock& held, const EndPointAddress& address,
                    std::shared_ptr<Listener> listener) {
    check_listen_free(held, address);
    m_listeners.emplace(address, std::move(listener));
  }

  [[nodiscard]] bool has_listener(const Lock& /*held*/, const EndPointAddress& address) const {
    return m_listeners.contains(address);
  }

  // Removes the listener and every connection it spawned (those are marked close-requested
  // and kept until remove()). Throws InvalidEndpointAddress / UnknownListenEndpoint.
  std::pair<std::shared_ptr<Listener>, std::vector<std::shared_ptr<Conn>>> take_listener(
      const Lock& /*held*/, const EndPointAddress& address) {
    const auto it = m_listeners.find(address);
    if (it == m_listeners.end()) {
      check_address(address, "close_listen_endpoint");
      throw UnknownListenEndpoint(fmt::format("{}: not listening on {}", m_backend, address));
    }
    auto listener = std::move(it->second);
    m_listeners.erase(it);
    const std::uint64_t id = listener->id;
    std::vector<std::shared_ptr<Conn>> children;
    for (auto c = m_connections.begin(); c != m_connections.end();) {
      if (c->second->listener_id == id) {
        c->second->close_requested.store(true);
        forget_last(c->second);
        m_closing.push_back(c->second);
        children.push_back(std::move(c->second));
        c = m_connections.erase(c);
      } else {
        ++c;
      }
    }
    return {std::move(listener), std::move(children)};
  }

  // ---- connections ---------------------------------------------------------------------

  // Every registered connection (open or being set up).
  [[nodiscard]] std::vector<std::shared_ptr<Conn>> connections(const Lock& /*held*/) const {
    std::vector<std::shared_ptr<Conn>> all;
    all.reserve(m_connections.size());
    for (const auto& [address, conn] : m_connections) all.push_back(conn);
    return all;
  }

  // The connection found last is tried first: a sender calls get_buffer and send_buffer for
  // one connection after another, and comparing an address costs less than hashing it.
  [[nodiscard]] std::shared_ptr<Conn> find(const Lock& /*held*/,
                                           const EndPointAddress& address) const {
    if (m_last && m_last->remote.port == address.port &&
        m_last->remote.address == address.address) {
      return m_last;
    }
    const auto it = m_connections.find(address);
    if (it == m_connections.end()) return nullptr;
    m_last = it->second;
    return it->second;
  }

  // The connection with `address` for a send: a registered one, else one that ended without
  // the application closing it and whose end was not reported yet (its sends are FAILED, as
  // the application cannot know yet that it ended). Throws InvalidEndpointAddress or
  // UnknownActiveEndpoint.
  // `ended`, if given, tells which of the two it is.
  [[nodiscard]] std::shared_ptr<Conn> get(const EndPointAddress& address, std::string_view api,
                                          bool* ended = nullptr) {
    {
      const Lock held = lock();
      if (auto conn = find(held, address)) return conn;
      if (const auto it = m_unreported.find(address); it != m_unreported.end()) {
        if (ended != nullptr) *ended = true;
        return it->second;
      }
    }
    check_address(address, api);
    throw UnknownActiveEndpoint(
        fmt::format("{}: {}: no connection with {}", m_backend, api, address));
  }

  // Throws ActiveEndpointAlreadyExists.
  void check_connection_free(const Lock& /*held*/, const EndPointAddress& address) const {
    if (m_connections.contains(address)) {
      throw ActiveEndpointAlreadyExists(
          fmt::format("{}: a connection with {} already exists", m_backend, address));
    }
  }

  // Adds a connection whose address was checked free under the same lock.
  void add_connection(const Lock& /*held*/, std::shared_ptr<Conn> conn) {
    const EndPointAddress address = conn->remote;
    m_connections.emplace(address, std::move(conn));
  }

  // Puts `fresh` (same remote address) in the place of `old`: false, and nothing changed, if
  // `old` is no longer registered (it was taken for close meanwhile).
  bool replace_connection(const Lock& /*held*/, const std::shared_ptr<Conn>& old,
                          std::shared_ptr<Conn> fresh) {
    const auto it = m_connections.find(old->remote);
    if (it == m_connections.end() || it->second != old) return false;
    it->second = std::move(fresh);
    forget_last(old);
    return true;
  }

  // For close_active_endpoint: removes the connection at once (its address can be opened
  // again), marks it close-requested and keeps it until remove(). Throws
  // InvalidEndpointAddress / UnknownActiveEndpoint.
  // A connection that ended by itself and was not reported yet is returned as it is (its
  // close has begun; it reports its end once).
  [[nodiscard]] std::shared_ptr<Conn> take_for_close(const Lock& /*held*/,
                                                     const EndPointAddress& address) {
    const auto it = m_connections.find(address);
    if (it == m_connections.end()) {
      if (const auto ended = m_unreported.find(address); ended != m_unreported.end()) {
        return ended->second;
      }
      check_address(address, "close_active_endpoint");
      throw UnknownActiveEndpoint(
          fmt::format("{}: close_active_endpoint: no connection with {}", m_backend, address));
    }
    auto conn = std::move(it->second);
    m_connections.erase(it);
    forget_last(conn);
    conn->close_requested.store(true);
    m_closing.push_back(conn);
    return conn;
  }

  // The loop began closing `conn`: it leaves the tables. With `until_reported`, one that
  // ended without the application closing it stays findable for sends (get()) until
  // reported().
  void remove(const Lock& /*held*/, const std::shared_ptr<Conn>& conn, bool until_reported) {
    const auto it = m_connections.find(conn->remote);
    if (it != m_connections.end() && it->second == conn) {
      m_connections.erase(it);
      if (until_reported && !conn->close_requested.load()) {
        m_unreported.insert_or_assign(conn->remote, conn);
      }
    }
    forget_last(conn);
    std::erase(m_closing, conn);
  }

  // The end of `conn` was reported (or will never be): sends to its address throw from now on.
  void reported(const Lock& /*held*/, const std::shared_ptr<Conn>& conn) {
    const auto it = m_unreported.find(conn->remote);
    if (it != m_unreported.end() && it->second == conn) m_unreported.erase(it);
  }

  // Everything, for the backend's shutdown; the registry is empty afterwards.
  struct Contents {
    std::vector<std::shared_ptr<Listener>> listeners;
    std::vector<std::shared_ptr<Conn>> connections;  // open, in set-up, or closing
  };
  [[nodiscard]] Contents take_all(const Lock& /*held*/) {
    Contents all;
    for (auto& [address, listener] : m_listeners) all.listeners.push_back(std::move(listener));
    for (auto& [address, conn] : m_connections) all.connections.push_back(std::move(conn));
    for (auto& conn : m_closing) all.connections.push_back(std::move(conn));
    // Those in m_unreported are closing: the engine's list of ending connections has them.
    m_listeners.clear();
    m_connections.clear();
    m_closing.clear();
    m_unreported.clear();
    m_last.reset();
    return all;
  }

  // Empties the index (backend shutdown, after take_all).
  void clear_index() {
    const std::lock_guard lock{m_index_mutex};
    m_by_id.clear();
    m_aliases.clear();
    m_listeners_by_id.clear();
  }

 private:
  // find()'s first try is always a registered connection.
  void forget_last(const std::shared_ptr<Conn>& conn) {
    if (m_last == conn) m_last.reset();
  }

  std::string_view m_backend;
  OptionalMutex m_mutex;
  std::unordered_map<EndPointAddress, std::shared_ptr<Listener>> m_listeners;
  std::unordered_map<EndPointAddress, std::shared_ptr<Conn>> m_connections;
  mutable std::shared_ptr<Conn> m_last;  // under m_mutex: the connection find() found last
  std::vector<std::shared_ptr<Conn>> m_closing;
  // Ended by the peer or an error, by remote address, until their end was reported.
  std::unordered_map<EndPointAddress, std::shared_ptr<Conn>> m_unreported;
  OptionalMutex m_index_mutex;
  std::unordered_map<std::uint64_t, std::weak_ptr<Conn>> m_by_id;
  std::unordered_map<std::uint64_t, std::weak_ptr<Conn>> m_aliases;
  std::unordered_map<std::uint64_t, std::weak_ptr<Listener>> m_listeners_by_id;
};

}  // namespace netio3::detail
