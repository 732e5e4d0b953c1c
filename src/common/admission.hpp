#pragma once

// Admission (docs/admission.md): the partition key's challenge and response, and the bodies
// of the frames that carry them. The cryptography is libsodium's (HMAC-SHA-256 and its
// constant-time check, the system's random numbers); nothing here is hand-written.
//
// A proof is HMAC-SHA-256, keyed with a hash of the partition key, over
//   "netio3 admission 1" | protocol name | 0 | prover's role | verifier's nonce |
//   prover's nonce | identity length (1 byte) | identity
// The verifier's nonce is fresh for each connection, so a proof recorded on one connection
// fails on any other (replay); the role keeps a proof from being reflected back to its maker.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <netio3/types.hpp>

namespace netio3::detail {

inline constexpr std::size_t ADMISSION_NONCE_SIZE = 16;
inline constexpr std::size_t ADMISSION_PROOF_SIZE = 32;
// A proof's first 16 bytes (HMAC-SHA-256 truncated to 128 bits): what libfabric's connection
// data carry, where a request has room for 56 bytes in all (verbs).
inline constexpr std::size_t ADMISSION_SHORT_PROOF_SIZE = 16;
inline constexpr std::size_t MAX_REFUSAL_REASON = 256;
// The largest admission frame body (a PROOF with the longest identity); frames before a
// connection is admitted are bounded by it, whatever the configured message size.
inline constexpr std::size_t MAX_ADMISSION_FRAME = 1 + ADMISSION_PROOF_SIZE + MAX_IDENTITY_SIZE;

using AdmissionNonce = std::array<std::uint8_t, ADMISSION_NONCE_SIZE>;
using AdmissionProof = std::array<std::uint8_t, ADMISSION_PROOF_SIZE>;

enum class AdmissionRole : std::uint8_t { CLIENT = 1, SERVER = 2 };

// The partition key as both sides use it (a hash of the configured secret); empty when none
// is configured. Wiped on destruction.
class PartitionKey {
 public:
  PartitionKey() = default;
  explicit PartitionKey(std::string_view secret);
  PartitionKey(const PartitionKey&) = delete;
  PartitionKey& operator=(const PartitionKey&) = delete;
  ~PartitionKey();

  [[nodiscard]] bool empty() const noexcept { return !m_set; }

  [[nodiscard]] AdmissionProof prove(std::string_view protocol, AdmissionRole prover,
                                     const AdmissionNonce& verifier_nonce,
                                     const AdmissionNonce& prover_nonce,
                                     std::string_view identity) const;
  // Constant time in the proof's content. `proof`: a whole proof, or its first
  // ADMISSION_SHORT_PROOF_SIZE bytes (libfabric); any other size fails.
  [[nodiscard]] bool verify(std::string_view protocol, AdmissionRole prover,
                            const AdmissionNonce& verifier_nonce,
                            const AdmissionNonce& prover_nonce, std::string_view identity,
                            std::span<const std::uint8_t> proof) const;

 private:
  std::array<std::uint8_t, 32> m_key{};
  bool m_set{false};
};

// A fresh nonce from the system's random source.
[[nodiscard]] AdmissionNonce make_nonce();
// A 64-bit number from the system's random source (UCX's connection tokens: a peer that has
// seen some must not be able to predict others).
[[nodiscard]] std::uint64_t random_u64();

// The configuration's admission settings checked (InvalidConfiguration with the reason).
void check_admission_config(const NetworkConfig& config);
// Admission is configured: a key or a hook.
[[nodiscard]] inline bool admission_configured(const NetworkConfig& config) noexcept {
  return !config.partition_key.empty() || static_cast<bool>(config.on_accept_cb);
}

// Frame bodies. CHALLENGE: the sender's nonce. PROOF: a flag byte (1: a proof follows), the
// proof, the identity (the rest, at most MAX_IDENTITY_SIZE). REFUSAL: the reason, text.
[[nodiscard]] std::vector<std::uint8_t> encode_challenge(const AdmissionNonce& nonce);
[[nodiscard]] std::optional<AdmissionNonce> decode_challenge(std::span<const std::uint8_t> body);

struct DecodedProof {
  std::optional<AdmissionProof> proof;  // none: an admission without a key (the hook only)
  std::string identity;
};
[[nodiscard]] std::vector<std::uint8_t> encode_proof(const std::optional<AdmissionProof>& proof,
                                                     std::string_view identity);
// Empty optional on a malformed body (`error` says why).
[[nodiscard]] std::optional<DecodedProof> decode_proof(std::span<const std::uint8_t> body,
                                                       std::string& error);

[[nodiscard]] std::vector<std::uint8_t> encode_refusal(std::string_view reason);
// The peer's reason as printable text (other bytes replaced), at most MAX_REFUSAL_REASON.
[[nodiscard]] std::string decode_refusal(std::span<const std::uint8_t> body);

// The two ways the sides of a set-up can disagree about a partition key, as the side that
// finds it says (every backend, both sides: one wording).
inline constexpr std::string_view PEER_HOLDS_NO_KEY =
    "the peer holds no partition key, and this side requires one";
inline constexpr std::string_view PEER_REQUIRES_KEY =
    "the peer requires a partition key, and this side has none";

// ---- the exchange, as both asyncmsg (1.3) and the UCX control channel (3.3) run it ---------
//
// One connection's admission state and what each arrival means; the backend does the
// sending, closing and refusing (docs/admission.md).

enum class AdmissionFrame : std::uint8_t { CHALLENGE, PROOF, REFUSAL };
[[nodiscard]] std::string_view to_string(AdmissionFrame frame) noexcept;

struct AdmissionStep {
  enum class Kind {
    WAIT,            // nothing to do yet (more frames must come)
    ADMIT,           // the peer is admitted: its HELLO / data may be read
    DECIDE,          // server: the peer proved the key (or needs no proof): run the hook
    SEND_PROOF,      // client: send `proof` (then its HELLO) and wait for the verdict
    NOT_ADMITTED,    // refuse with `text`
    PROTOCOL_ERROR,  // close with `text`
    REFUSED          // client: the server refused; `text` is its reason
  };
  Kind kind{Kind::WAIT};
  std::string text{};
  std::string identity{};             // DECIDE: what the peer presented
  std::vector<std::uint8_t> proof{};  // SEND_PROOF: the PROOF frame's body
};

class AdmissionExchange {
 public:
  // `protocol` names the backend in the proofs ("asyncmsg", "ucx"); `client`: this side
  // connected; `hook`: this side (a server) has an accept hook. `key` outlives the exchange.
  AdmissionExchange(const PartitionKey& key, std::string_view protocol, bool client, bool hook,
                    std::string_view identity) noexcept
      : m_key{&key}, m_protocol{protocol}, m_identity{identity}, m_client{client}, m_hook{hook} {}

  // Greeting flags this side sends; and the CHALLENGE body that follows them (a fresh nonce),
  // when keyed(). Call again after a reconnection: the exchange starts over.
  [[nodiscard]] std::uint32_t greeting_flags() const noexcept;
  [[nodiscard]] std::vector<std::uint8_t> start();
  [[nodiscard]] bool keyed() const noexcept { return !m_key->empty(); }
  // The side sends its HELLO with its greeting: no admission holds it back.
  [[nodiscard]] bool hello_with_greeting() const noexcept { return greeting_flags() == 0; }

  [[nodiscard]] AdmissionStep on_greeting(std::uint16_t minor, std::uint32_t flags);
  [[nodiscard]] AdmissionStep on_frame(AdmissionFrame frame, std::span<const std::uint8_t> body);
  // Server, admitting: the PROOF frame's body to send, or none for a peer older than
  // `admission_minor` that knows no such frame (possible only without a key).
  [[nodiscard]] std::optional<std::vector<std::uint8_t>> verdict(std::uint16_t admission_minor);
  // Server, refusing: whether the peer knows a REFUSAL frame.
  [[nodiscard]] bool peer_takes_refusal(std::uint16_t admission_minor) const noexcept {
    return m_peer_minor >= admission_minor;
  }
  [[nodiscard]] bool admitted() const noexcept { return m_admitted; }

 private:
  const PartitionKey* m_key;
  std::string_view m_protocol;
  std::string_view m_identity;
  bool m_client;
  bool m_hook;
  AdmissionNonce m_own{};
  std::optional<AdmissionNonce> m_peer;
  std::uint16_t m_peer_minor{0};
  bool m_peer_keyed{false};
  bool m_awaiting_verdict{false};
  bool m_admitted{false};
};

// Runs the accept hook: its decision, or a refusal when it throws. An empty reason of a
// refusal becomes "refused by the application's accept hook".
[[nodiscard]] AcceptDecision run_accept_hook(const OnAcceptCb& hook, const PeerInfo& peer,
                                             std::string_view backend);

}  // namespace netio3::detail
