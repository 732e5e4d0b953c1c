#pragma once

// The admission of a connection whose set-up travels as frames of a netio3 stream (common/
// wire.hpp): asyncmsg's data stream and the UCX backend's control channel (docs/admission.md).
// AdmissionExchange (common/admission.hpp) knows the exchange - nonces, proofs, what may come
// when - and answers each greeting and frame with a step; this acts on the steps, asks the
// accept hook and refuses, the same way for both backends. libfabric admits through the
// connection data of its requests instead (backends/libfabric/accepting.cpp).
//
// A backend derives from StreamAdmission<Backend, Connection> (and makes it a friend) and
// supplies:
//   static constexpr SetupFrames SETUP_FRAMES;         its name, frame types, protocol minor
//   NetworkConfig m_config;                            (the engine's) the accept hook, identity
//   PartitionKey m_key;                                the partition key
//   void refuse(conn, RefusalCause, std::string_view); (the engine's) the set-up fails
//   bool setup_alive(const Conn&);                     the set-up may go on: the connection is
//                                                      not closing, the backend not shut down
//   void write_setup(conn, std::span<const uint8_t>);  writes set-up frames behind the greeting
//   void add_to_verdict(Conn&, std::vector<uint8_t>&); a server's frames behind its PROOF
//   bool admitted(conn);                               the peer is admitted: go on (false: the
//                                                      connection went meanwhile)
//   void refuse_and_linger(Conn&, std::span<const uint8_t> refusal);
//                                                      server: writes the REFUSAL frame (empty:
//                                                      none) directly if nothing else is queued,
//                                                      and lets the socket linger after the close
//   bool setup_protocol_error(conn, std::string_view); closes the connection; false
// All of it runs on the loop thread.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <netio3/network_backend.hpp>
#include <netio3/types.hpp>

#include "common/admission.hpp"
#include "common/connection.hpp"
#include "common/log.hpp"
#include "common/wire.hpp"

namespace netio3::detail {

// A backend's name (in log lines and the accept hook's refusals), its admission frame types,
// and the minor version of its protocol that brought them (an older peer is sent neither a
// PROOF nor a REFUSAL: it would reject the frame type).
struct SetupFrames {
  std::string_view backend;
  std::uint8_t challenge{};
  std::uint8_t proof{};
  std::uint8_t refusal{};
  std::uint16_t admission_minor{};
  std::uint16_t ack_minor{};  // the first minor version that acknowledges deliveries
};

template <typename Derived, typename Conn>
class StreamAdmission {
 protected:
  // A set-up frame of `type`: an admission frame is handed to the exchange (the result says
  // whether to go on decoding); nullopt for any other type.
  std::optional<bool> admission_frame(const std::shared_ptr<Conn>& conn, std::uint8_t type,
                                      std::span<const std::uint8_t> body) {
    constexpr auto frames = Derived::SETUP_FRAMES;
    AdmissionFrame kind{};
    if (type == frames.challenge) {
      kind = AdmissionFrame::CHALLENGE;
    } else if (type == frames.proof) {
      kind = AdmissionFrame::PROOF;
    } else if (type == frames.refusal) {
      kind = AdmissionFrame::REFUSAL;
    } else {
      return std::nullopt;
    }
    if (!self().setup_alive(*conn) || conn->close_requested.load()) return false;
    return admission_step(conn, conn->admission->on_frame(kind, body));
  }

  // What this side sends first: its greeting (`greeting`, its flags joined by admission's and
  // ACKNOWLEDGE when its sends are to be acknowledged: a keyed side
  // announces it, a server with a key or an accept hook tells the client to wait for its
  // verdict) and, with a key, its CHALLENGE. Starts the connection's admission exchange.
  std::vector<std::uint8_t> admission_opening(Conn& conn, Greeting greeting) {
    auto& backend = self();
    if (!conn.admission) {
      conn.admission.emplace(backend.m_key, Derived::SETUP_FRAMES.backend, conn.active(),
                             static_cast<bool>(backend.m_config.on_accept_cb),
                             backend.m_config.identity);
    }
    const auto challenge = conn.admission->start();
    greeting.flags |= conn.admission->greeting_flags();
    if (conn.params.delivery.acknowledged || conn.session.enabled) {
      greeting.flags |= GREETING_ACKNOWLEDGE;
    }
    if (conn.session.enabled) greeting.flags |= GREETING_SESSION;
    const auto encoded = encode_greeting(greeting);
    std::vector<std::uint8_t> out{encoded.begin(), encoded.end()};
    if (!challenge.empty()) {
      const auto challenge_frame = encode_frame(Derived::SETUP_FRAMES.challenge, challenge);
      out.insert(out.end(), challenge_frame.begin(), challenge_frame.end());
    }
    return out;
  }

  // The peer's greeting, once its limits were taken: whether it asks for acknowledgements and
  // can give them (a connection whose sends are acknowledged is not set up with a peer that
  // cannot), then admission.
  bool admission_greeting(const std::shared_ptr<Conn>& conn, const Greeting& greeting) {
    const bool peer_acknowledges = greeting.minor >= Derived::SETUP_FRAMES.ack_minor;
    conn->acks.peer_wants_acks = peer_acknowledges && (greeting.flags & GREETING_ACKNOWLEDGE) != 0;
    if ((conn->params.delivery.acknowledged || conn->session.enabled) && !peer_acknowledges) {
      return self().setup_protocol_error(conn, PEER_CANNOT_ACKNOWLEDGE);
    }
    return admission_step(conn, conn->admission->on_greeting(greeting.minor, greeting.flags));
  }

  // Acts on a step of the connection's admission exchange; whether to go on decoding.
  bool admission_step(const std::shared_ptr<Conn>& conn, AdmissionStep step) {
    auto& backend = self();
    using Kind = AdmissionStep::Kind;
    switch (step.kind) {
      case Kind::WAIT:
        return backend.setup_alive(*conn);
      case Kind::ADMIT:
        return backend.admitted(conn);
      case Kind::DECIDE:
        return decide(conn, std::move(step.identity));
      case Kind::SEND_PROOF:
        backend.write_setup(conn, encode_frame(Derived::SETUP_FRAMES.proof, step.proof));
        return backend.setup_alive(*conn);
      case Kind::NOT_ADMITTED:
        return not_admitted(conn, step.text);
      case Kind::PROTOCOL_ERROR:
        return backend.setup_protocol_error(conn, step.text);
      case Kind::REFUSED:
        NETIO3_WARN("{}: connection to {} not admitted: {}", Derived::SETUP_FRAMES.backend,
                    conn->remote, step.text);
        backend.refuse(conn, RefusalCause::NOT_ADMITTED, step.text);
        return false;
    }
    return false;
  }

  // Server: asks the accept hook (if any), then answers with its PROOF (and what the backend
  // adds to it), or refuses.
  bool decide(const std::shared_ptr<Conn>& conn, std::string&& identity) {
    auto& backend = self();
    if (backend.m_config.on_accept_cb) {
      const PeerInfo peer{.remote = conn->remote,
                          .listener = conn->listener_address,
                          .identity = std::move(identity),
                          .key_proven = conn->admission->keyed()};
      const AcceptDecision decision =
          run_accept_hook(backend.m_config.on_accept_cb, peer, Derived::SETUP_FRAMES.backend);
      // The hook may have closed the connection or destroyed the backend.
      if (!backend.setup_alive(*conn) || conn->close_requested.load()) return false;
      if (!decision.admit) return not_admitted(conn, decision.reason);
    }
    // No PROOF without a key (the verdict alone), and none to a client older than admission
    // (possible only without a key), which took the greeting for the set-up.
    std::vector<std::uint8_t> out;
    if (const auto proof = conn->admission->verdict(Derived::SETUP_FRAMES.admission_minor)) {
      out = encode_frame(Derived::SETUP_FRAMES.proof, *proof);
    }
    backend.add_to_verdict(*conn, out);
    if (!out.empty()) {
      backend.write_setup(conn, out);
      if (!backend.setup_alive(*conn)) return false;
    }
    return backend.admitted(conn);
  }

  // Ends the set-up: a REFUSAL with the reason to a client (then the socket lingers, so that
  // the client reads the reason rather than a reset), NOT_ADMITTED for a client.
  bool not_admitted(const std::shared_ptr<Conn>& conn, std::string_view reason) {
    auto& backend = self();
    if (!conn->active()) {
      NETIO3_WARN("{}: refusing connection from {} on {}: {}", Derived::SETUP_FRAMES.backend,
                  conn->remote, conn->listener_address, reason);
      std::vector<std::uint8_t> refusal;
      if (conn->admission->peer_takes_refusal(Derived::SETUP_FRAMES.admission_minor)) {
        refusal = encode_frame(Derived::SETUP_FRAMES.refusal, encode_refusal(reason));
      }
      backend.refuse_and_linger(*conn, refusal);
    } else {
      NETIO3_WARN("{}: connection to {} not admitted: {}", Derived::SETUP_FRAMES.backend,
                  conn->remote, reason);
    }
    backend.refuse(conn, RefusalCause::NOT_ADMITTED, reason);
    return false;
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

}  // namespace netio3::detail
