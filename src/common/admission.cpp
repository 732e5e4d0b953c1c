#include "common/admission.hpp"

#include <algorithm>
#include <sodium.h>
#include <stdexcept>

#include <fmt/format.h>
#include <netio3/exceptions.hpp>

namespace netio3::detail {
namespace {

constexpr std::string_view LABEL = "netio3 admission 1";
constexpr std::uint8_t PROOF_PRESENT = 1;
constexpr std::uint8_t PROOF_ABSENT = 0;

static_assert(ADMISSION_PROOF_SIZE == crypto_auth_hmacsha256_BYTES);

void ensure_sodium() {
  // Thread-safe and idempotent; fails only when the system has no random source.
  if (sodium_init() < 0) throw std::runtime_error("libsodium could not be initialised");
}

AdmissionProof compute(const std::array<std::uint8_t, 32>& key, std::string_view protocol,
                       AdmissionRole prover, const AdmissionNonce& verifier_nonce,
                       const AdmissionNonce& prover_nonce, std::string_view identity) {
  crypto_auth_hmacsha256_state state;
  crypto_auth_hmacsha256_init(&state, key.data(), key.size());
  const auto add = [&state](const void* p, std::size_t n) {
    crypto_auth_hmacsha256_update(&state, static_cast<const unsigned char*>(p), n);
  };
  const std::uint8_t zero = 0;
  const auto role = static_cast<std::uint8_t>(prover);
  const auto identity_size = static_cast<std::uint8_t>(identity.size());
  add(LABEL.data(), LABEL.size());
  add(protocol.data(), protocol.size());
  add(&zero, 1);
  add(&role, 1);
  add(verifier_nonce.data(), verifier_nonce.size());
  add(prover_nonce.data(), prover_nonce.size());
  add(&identity_size, 1);
  add(identity.data(), identity.size());
  AdmissionProof out{};
  crypto_auth_hmacsha256_final(&state, out.data());
  sodium_memzero(&state, sizeof state);
  return out;
}

}  // namespace

PartitionKey::PartitionKey(std::string_view secret) {
  if (secret.empty()) return;
  ensure_sodium();
  crypto_generichash(m_key.data(), m_key.size(),
                     reinterpret_cast<const unsigned char*>(secret.data()), secret.size(), nullptr,
                     0);
  m_set = true;
}

PartitionKey::~PartitionKey() {
  sodium_memzero(m_key.data(), m_key.size());
}

AdmissionProof PartitionKey::prove(std::string_view protocol, AdmissionRole prover,
                                   const AdmissionNonce& verifier_nonce,
                                   const AdmissionNonce& prover_nonce,
                                   std::string_view identity) const {
  return compute(m_key, protocol, prover, verifier_nonce, prover_nonce, identity);
}

bool PartitionKey::verify(std::string_view protocol, AdmissionRole prover,
                          const AdmissionNonce& verifier_nonce, const AdmissionNonce& prover_nonce,
                          std::string_view identity, std::span<const std::uint8_t> proof) const {
  if (!m_set || proof.size() != ADMISSION_PROOF_SIZE || identity.size() > MAX_IDENTITY_SIZE) {
    return false;
  }
  const AdmissionProof expected =
      compute(m_key, protocol, prover, verifier_nonce, prover_nonce, identity);
  return sodium_memcmp(expected.data(), proof.data(), ADMISSION_PROOF_SIZE) == 0;
}

AdmissionNonce make_nonce() {
  ensure_sodium();
  AdmissionNonce nonce{};
  randombytes_buf(nonce.data(), nonce.size());
  return nonce;
}

std::uint64_t random_u64() {
  ensure_sodium();
  std::uint64_t value = 0;
  randombytes_buf(&value, sizeof value);
  return value;
}

void check_admission_config(const NetworkConfig& config) {
  if (!config.partition_key.empty() && config.partition_key.size() < MIN_PARTITION_KEY_SIZE) {
    throw InvalidConfiguration(
        fmt::format("partition_key must be empty (no key) or at least {} bytes long (got {} bytes)",
                    MIN_PARTITION_KEY_SIZE, config.partition_key.size()));
  }
  if (config.identity.size() > MAX_IDENTITY_SIZE) {
    throw InvalidConfiguration(fmt::format("identity must be at most {} bytes long (got {})",
                                           MAX_IDENTITY_SIZE, config.identity.size()));
  }
  if (!config.identity.empty() && config.partition_key.empty()) {
    throw InvalidConfiguration(
        "identity needs a partition_key: it is presented inside the proof of the key, and a "
        "name without a proof would admit anyone who claims it");
  }
}

std::vector<std::uint8_t> encode_challenge(const AdmissionNonce& nonce) {
  return {nonce.begin(), nonce.end()};
}

std::optional<AdmissionNonce> decode_challenge(std::span<const std::uint8_t> body) {
  if (body.size() != ADMISSION_NONCE_SIZE) return std::nullopt;
  AdmissionNonce nonce{};
  std::copy(body.begin(), body.end(), nonce.begin());
  return nonce;
}

std::vector<std::uint8_t> encode_proof(const std::optional<AdmissionProof>& proof,
                                       std::string_view identity) {
  std::vector<std::uint8_t> out;
  out.reserve(1 + ADMISSION_PROOF_SIZE + identity.size());
  out.push_back(proof ? PROOF_PRESENT : PROOF_ABSENT);
  if (proof) out.insert(out.end(), proof->begin(), proof->end());
  out.insert(out.end(), identity.begin(), identity.end());
  return out;
}

std::optional<DecodedProof> decode_proof(std::span<const std::uint8_t> body, std::string& error) {
  if (body.empty()) {
    error = "an empty PROOF frame";
    return std::nullopt;
  }
  DecodedProof out;
  std::size_t at = 1;
  if (body[0] == PROOF_PRESENT) {
    if (body.size() < 1 + ADMISSION_PROOF_SIZE) {
      error = fmt::format("a PROOF frame of {} bytes, too short for its proof", body.size());
      return std::nullopt;
    }
    AdmissionProof proof{};
    std::copy_n(body.begin() + 1, ADMISSION_PROOF_SIZE, proof.begin());
    out.proof = proof;
    at += ADMISSION_PROOF_SIZE;
  } else if (body[0] != PROOF_ABSENT) {
    error = fmt::format("a PROOF frame with flags {:#04x}", body[0]);
    return std::nullopt;
  }
  const auto identity = body.subspan(at);
  if (identity.size() > MAX_IDENTITY_SIZE) {
    error = fmt::format("a PROOF frame with an identity of {} bytes (at most {})", identity.size(),
                        MAX_IDENTITY_SIZE);
    return std::nullopt;
  }
  out.identity.assign(identity.begin(), identity.end());
  return out;
}

std::vector<std::uint8_t> encode_refusal(std::string_view reason) {
  const auto kept = reason.substr(0, MAX_REFUSAL_REASON);
  return {kept.begin(), kept.end()};
}

std::string decode_refusal(std::span<const std::uint8_t> body) {
  std::string out;
  const auto kept = body.first(std::min(body.size(), MAX_REFUSAL_REASON));
  out.reserve(kept.size());
  for (const std::uint8_t c : kept) {
    out.push_back(c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?');
  }
  return out;
}

AcceptDecision run_accept_hook(const OnAcceptCb& hook, const PeerInfo& peer,
                               std::string_view backend) {
  AcceptDecision decision;
  try {
    decision = hook(peer);
  } catch (const std::exception& e) {
    return AcceptDecision::refuse(fmt::format("the accept hook failed: {}", e.what()));
  } catch (...) {
    return AcceptDecision::refuse("the accept hook failed with an exception");
  }
  if (!decision.admit && decision.reason.empty()) {
    decision.reason = fmt::format("refused by the {} server's accept hook", backend);
  }
  return decision;
}

}  // namespace netio3::detail
