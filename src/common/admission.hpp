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
  // Constant time in the proof's content.
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

// Runs the accept hook: its decision, or a refusal when it throws. An empty reason of a
// refusal becomes "refused by the application's accept hook".
[[nodiscard]] AcceptDecision run_accept_hook(const OnAcceptCb& hook, const PeerInfo& peer,
                                             std::string_view backend);

}  // namespace netio3::detail
