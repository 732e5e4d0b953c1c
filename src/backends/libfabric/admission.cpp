#include "backends/libfabric/admission.hpp"

#include <algorithm>

#include "common/byte_order.hpp"

namespace netio3::libfabric {
namespace {

constexpr std::size_t ID_SIZE = 8;

void append(std::vector<std::uint8_t>& out, std::span<const std::uint8_t> bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}

void append_id(std::vector<std::uint8_t>& out, std::uint64_t id) {
  std::array<std::uint8_t, ID_SIZE> bytes{};
  detail::store_le64(bytes.data(), id);
  append(out, bytes);
}

void append_identity(std::vector<std::uint8_t>& out, std::string_view identity) {
  out.push_back(static_cast<std::uint8_t>(identity.size()));
  out.insert(out.end(), identity.begin(), identity.end());
}

// An identity (length byte, then exactly that many bytes) that is all of `bytes`.
std::optional<std::string> read_identity(std::span<const std::uint8_t> bytes) {
  if (bytes.empty() || bytes.size() != std::size_t{1} + bytes[0]) return std::nullopt;
  return std::string(bytes.begin() + 1, bytes.end());
}

template <std::size_t N>
std::array<std::uint8_t, N> read_array(std::span<const std::uint8_t> bytes) {
  std::array<std::uint8_t, N> out{};
  std::copy_n(bytes.begin(), N, out.begin());
  return out;
}

}  // namespace

std::span<const std::uint8_t> cm_tail(std::span<const std::uint8_t> data) noexcept {
  return data.size() > CM_DATA_SIZE ? data.subspan(CM_DATA_SIZE) : std::span<const std::uint8_t>{};
}

std::vector<std::uint8_t> encode_cm(const CmData& data, std::span<const std::uint8_t> tail) {
  const auto head = encode_cm_data(data);
  std::vector<std::uint8_t> out(head.begin(), head.end());
  append(out, tail);
  return out;
}

std::vector<std::uint8_t> encode(const KeyedRequest& request) {
  std::vector<std::uint8_t> out(request.nonce.begin(), request.nonce.end());
  append_identity(out, request.identity);
  return out;
}

std::vector<std::uint8_t> encode(const Challenge& challenge) {
  std::vector<std::uint8_t> out;
  append_id(out, challenge.id);
  append(out, challenge.nonce);
  return out;
}

std::vector<std::uint8_t> encode(const ProofRequest& request) {
  std::vector<std::uint8_t> out;
  append_id(out, request.id);
  append(out, request.proof);
  return out;
}

std::vector<std::uint8_t> encode(const ServerProof& proof) {
  std::vector<std::uint8_t> out(proof.proof.begin(), proof.proof.end());
  append_identity(out, proof.identity);
  return out;
}

std::optional<KeyedRequest> decode_keyed_request(std::span<const std::uint8_t> tail) {
  if (tail.size() < detail::ADMISSION_NONCE_SIZE) return std::nullopt;
  auto identity = read_identity(tail.subspan(detail::ADMISSION_NONCE_SIZE));
  if (!identity) return std::nullopt;
  return KeyedRequest{.nonce = read_array<detail::ADMISSION_NONCE_SIZE>(tail),
                      .identity = std::move(*identity)};
}

std::optional<Challenge> decode_challenge(std::span<const std::uint8_t> tail) {
  if (tail.size() != ID_SIZE + detail::ADMISSION_NONCE_SIZE) return std::nullopt;
  return Challenge{.id = detail::load_le64(tail.data()),
                   .nonce = read_array<detail::ADMISSION_NONCE_SIZE>(tail.subspan(ID_SIZE))};
}

std::optional<ProofRequest> decode_proof_request(std::span<const std::uint8_t> tail) {
  if (tail.size() != ID_SIZE + detail::ADMISSION_SHORT_PROOF_SIZE) return std::nullopt;
  return ProofRequest{
      .id = detail::load_le64(tail.data()),
      .proof = read_array<detail::ADMISSION_SHORT_PROOF_SIZE>(tail.subspan(ID_SIZE))};
}

std::optional<ServerProof> decode_server_proof(std::span<const std::uint8_t> tail) {
  if (tail.size() < detail::ADMISSION_SHORT_PROOF_SIZE) return std::nullopt;
  auto identity = read_identity(tail.subspan(detail::ADMISSION_SHORT_PROOF_SIZE));
  if (!identity) return std::nullopt;
  return ServerProof{.proof = read_array<detail::ADMISSION_SHORT_PROOF_SIZE>(tail),
                     .identity = std::move(*identity)};
}

ShortProof short_proof(const detail::AdmissionProof& proof) noexcept {
  ShortProof out{};
  std::copy_n(proof.begin(), out.size(), out.begin());
  return out;
}

Challenge ChallengeTable::issue(std::uint64_t listener, std::string source, KeyedRequest request,
                                Clock::duration ttl, Clock::time_point now) {
  // The oldest pending challenge gives way (ids in m_order that were taken are skipped).
  while (m_pending.size() >= CAPACITY && !m_order.empty()) {
    m_pending.erase(m_order.front());
    m_order.pop_front();
  }
  // Ids taken by answers stay in m_order until they reach its front: at twice CAPACITY, only
  // the pending ones are kept.
  if (m_order.size() >= 2 * CAPACITY) {
    std::erase_if(m_order, [this](std::uint64_t id) { return !m_pending.contains(id); });
  }
  Challenge challenge{.id = detail::random_u64(), .nonce = detail::make_nonce()};
  while (m_pending.contains(challenge.id)) challenge.id = detail::random_u64();
  m_pending.emplace(challenge.id, Entry{.listener = listener,
                                        .source = std::move(source),
                                        .client = request.nonce,
                                        .server = challenge.nonce,
                                        .identity = std::move(request.identity),
                                        .expires = now + ttl});
  m_order.push_back(challenge.id);
  return challenge;
}

std::optional<ChallengeTable::Entry> ChallengeTable::take(std::uint64_t id,
                                                          const std::string& source,
                                                          Clock::time_point now) {
  const auto it = m_pending.find(id);
  if (it == m_pending.end() || it->second.source != source) return std::nullopt;
  Entry entry = std::move(it->second);
  m_pending.erase(it);
  if (entry.expires <= now) return std::nullopt;
  return entry;
}

}  // namespace netio3::libfabric
