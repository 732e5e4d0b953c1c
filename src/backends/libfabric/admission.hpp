#pragma once

// Admission on libfabric (docs/admission.md): the partition key's challenge and response in
// connection data. A connection request cannot wait for an answer before fi_accept, so a keyed
// client asks twice:
//
//   1. request, CM_KEYED:            CmData | client nonce (16) | identity length (1) | identity
//      the server rejects it with a challenge, CM_CHALLENGE:
//                                    CmData | challenge id (8) | server nonce (16)
//   2. request, CM_KEYED | CM_PROOF: CmData | challenge id (8) | client proof (16)
//      the server takes the challenge (each is answered once, within connect_timeout), checks
//      the proof, asks the accept hook, and accepts, CM_KEYED:
//                                    CmData | server proof (16) | identity length (1) | identity
//      or rejects, CM_NOT_ADMITTED:  CmData | reason (text)
//
// Proofs are the first 16 bytes of detail::PartitionKey's proofs for protocol "libfabric":
// the client's over (server nonce, client nonce, client identity), the server's over (client
// nonce, server nonce, server identity). The second request is 48 bytes, within the 55 that
// libfabric's verbs provider carries (rdma_cm's 56 less its length byte); the first has room
// there for an identity of 14 bytes (the tcp provider carries 256).

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "backends/libfabric/fabric.hpp"
#include "common/admission.hpp"

namespace netio3::libfabric {

inline constexpr std::string_view ADMISSION_PROTOCOL = "libfabric";
using ShortProof = std::array<std::uint8_t, detail::ADMISSION_SHORT_PROOF_SIZE>;

struct KeyedRequest {
  detail::AdmissionNonce nonce{};
  std::string identity{};
};
struct Challenge {
  std::uint64_t id{};
  detail::AdmissionNonce nonce{};
};
struct ProofRequest {
  std::uint64_t id{};
  ShortProof proof{};
};
struct ServerProof {
  ShortProof proof{};
  std::string identity{};
};

// What follows the CmData in `data` (empty when nothing does).
[[nodiscard]] std::span<const std::uint8_t> cm_tail(std::span<const std::uint8_t> data) noexcept;
// CmData followed by `tail`.
[[nodiscard]] std::vector<std::uint8_t> encode_cm(const CmData& data,
                                                  std::span<const std::uint8_t> tail);

[[nodiscard]] std::vector<std::uint8_t> encode(const KeyedRequest& request);
[[nodiscard]] std::vector<std::uint8_t> encode(const Challenge& challenge);
[[nodiscard]] std::vector<std::uint8_t> encode(const ProofRequest& request);
[[nodiscard]] std::vector<std::uint8_t> encode(const ServerProof& proof);
// Each: none for a tail of the wrong size (an identity's length byte must match the rest).
[[nodiscard]] std::optional<KeyedRequest> decode_keyed_request(std::span<const std::uint8_t> tail);
[[nodiscard]] std::optional<Challenge> decode_challenge(std::span<const std::uint8_t> tail);
[[nodiscard]] std::optional<ProofRequest> decode_proof_request(std::span<const std::uint8_t> tail);
[[nodiscard]] std::optional<ServerProof> decode_server_proof(std::span<const std::uint8_t> tail);

[[nodiscard]] ShortProof short_proof(const detail::AdmissionProof& proof) noexcept;

// A server's challenges that wait for the client's second request (loop thread). Bounded: at
// CAPACITY the oldest pending challenge gives way to the new one, so a flood of first
// requests neither grows the table nor locks clients out (a client answers within a round
// trip; a flood must send CAPACITY requests within it to drop that client's challenge).
class ChallengeTable {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::size_t CAPACITY = 1024;

  struct Entry {
    std::uint64_t listener{};
    std::string source;  // the IP address the first request came from
    detail::AdmissionNonce client{};
    detail::AdmissionNonce server{};
    std::string identity{};
    Clock::time_point expires{};
  };

  // A new challenge (a fresh id and nonce) for `request` through `listener` from IP address
  // `source`, valid for `ttl`.
  [[nodiscard]] Challenge issue(std::uint64_t listener, std::string source, KeyedRequest request,
                                Clock::duration ttl, Clock::time_point now);
  // The pending challenge `id`, taken out (it is answered once); none when it is unknown, was
  // answered already or expired. An answer from another IP address than the first request's
  // gets none and leaves the challenge to the client it was issued to (the second request
  // comes from a new endpoint, so from another port, but from the client's address): a
  // captured second request replayed from elsewhere is neither admitted nor able to spend
  // the real client's challenge.
  [[nodiscard]] std::optional<Entry> take(std::uint64_t id, const std::string& source,
                                          Clock::time_point now);
  [[nodiscard]] std::size_t size() const noexcept { return m_pending.size(); }

 private:
  std::unordered_map<std::uint64_t, Entry> m_pending;
  std::deque<std::uint64_t> m_order;  // ids in the order issued (some taken already)
};

}  // namespace netio3::libfabric
