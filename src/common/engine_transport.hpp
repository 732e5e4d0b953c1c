#pragma once

// What a transport implements for the connection engine (common/connection_engine.hpp): the
// concept TransportOf, and how send_data's payload is handed to it.

#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <sys/uio.h>
#include <utility>

#include <netio3/network_buffer.hpp>
#include <netio3/types.hpp>

#include "common/send_ledger.hpp"

namespace netio3::detail {

// The transport's half of a backend (Derived, for connections Conn and listeners L):
//  - close_transport(conn): the connection is CLOSING (conn->ending_info says why); begin
//    closing the transport's side of it - gracefully for a local or peer close of an open
//    connection. Calls no user callback.
//  - quiescent(conn): nothing the transport still holds of the connection has to end before
//    its end is reported (sends whose completion is still to come, and the like).
//  - abandon(conn): drop it without callbacks (the backend is being destroyed).
//  - close_listener(listener): stop accepting on it (close_listen_endpoint).
//  - post_buffer(conn, buffer): send_buffer after the engine's checks; the buffer is
//    claimed, and handed back to its pool by the engine unless OK is returned.
//  - post_data(conn, header, iov, payload, pending): send_data (Payload::REFERENCE: the
//    payload is sent from where it lies until the send completes) or send_data_copy
//    (Payload::COPY: it is copied before the call returns), after the engine's checks. A
//    transport whose connections have a registered region (Conn::region) gets only payloads
//    inside it; one that cannot copy declares static NO_COPY_SENDS (why, for NotSupported).
//  - send_heartbeat(conn): the connection is open and its peer takes heartbeats: send one
//    (dropped when the transport has no room for it now; the next comes one period later).
//    It may close the connection (the send failed), which may run the closed callback.
//  - send_ack(conn, count): the connection is open (or, for the last one, being closed by
//    the application) and its peer wants its sends acknowledged: tell it that `count` of
//    its messages were handed to on_data_cb. False when the transport has no room for it
//    now (it is sent again next round); never lost once accepted (a peer's sends would
//    wait for it); before the connection's goodbye. It may close the connection as
//    send_heartbeat does.
// and may implement
//  - after_closed(conn): the connection is CLOSED (its end is about to be reported): free
//    what the transport kept for it. No callback.
//  - receiving(conn) -> bool: false while the transport does not read the connection, or
//    holds bytes from the peer it has not read yet that grew since the last tick (the
//    peer's silence is not judged then). Always true if absent.
// How send_data's and send_data_copy's payload is handed to the transport.
enum class Payload : std::uint8_t { REFERENCE, COPY };

template <typename T, typename Conn, typename L>
concept TransportOf = requires(T& t, const std::shared_ptr<Conn>& conn, Conn& c,
                               NetworkBuffer* buffer) {
  { t.close_transport(conn) } -> std::same_as<void>;
  { std::as_const(t).quiescent(std::as_const(c)) } -> std::same_as<bool>;
  { T::abandon(c) }
  noexcept;
  { t.close_listener(std::shared_ptr<L>{}) } -> std::same_as<void>;
  { t.post_buffer(conn, buffer) } -> std::same_as<NetioStatus>;
  { t.send_heartbeat(conn) } -> std::same_as<void>;
  { t.send_ack(conn, std::uint64_t{}) } -> std::same_as<bool>;
  {
    t.post_data(conn, std::span<const std::uint8_t>{}, std::span<const iovec>{}, Payload::COPY,
                PendingSend{})
    } -> std::same_as<NetioStatus>;
};

}  // namespace netio3::detail
