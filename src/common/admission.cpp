#include "common/admission.hpp"

#include <algorithm>
#include <sodium.h>
#include <stdexcept>

#include <fmt/format.h>
#include <netio3/exceptions.hpp>

#include "common/wire.hpp"

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
  const bool sized =
      proof.size() == ADMISSION_PROOF_SIZE || proof.size() == ADMISSION_SHORT_PROOF_SIZE;
  if (!m_set || !sized || identity.size() > MAX_IDENTITY_SIZE) return false;
  const AdmissionProof expected =
      compute(m_key, protocol, prover, verifier_nonce, prover_nonce, identity);
  return sodium_memcmp(expected.data(), proof.data(), proof.size()) == 0;
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

std::string_view to_string(AdmissionFrame frame) noexcept {
  switch (frame) {
    case AdmissionFrame::CHALLENGE:
      return "CHALLENGE";
    case AdmissionFrame::PROOF:
      return "PROOF";
    case AdmissionFrame::REFUSAL:
      return "REFUSAL";
  }
  return "?";
}

std::uint32_t AdmissionExchange::greeting_flags() const noexcept {
  std::uint32_t flags = 0;
  if (keyed()) flags |= GREETING_KEYED;
  if (!m_client && (keyed() || m_hook)) flags |= GREETING_VERDICT;
  return flags;
}

std::vector<std::uint8_t> AdmissionExchange::start() {
  m_peer.reset();
  m_peer_minor = 0;
  m_peer_keyed = false;
  m_awaiting_verdict = false;
  m_admitted = false;
  if (!keyed()) return {};
  m_own = make_nonce();
  return encode_challenge(m_own);
}

AdmissionStep AdmissionExchange::on_greeting(std::uint16_t minor, std::uint32_t flags) {
  using Kind = AdmissionStep::Kind;
  m_peer_minor = minor;
  m_peer_keyed = (flags & GREETING_KEYED) != 0;
  if (keyed() != m_peer_keyed) {
    return {.kind = Kind::NOT_ADMITTED,
            .text = std::string{keyed() ? PEER_HOLDS_NO_KEY : PEER_REQUIRES_KEY}};
  }
  if (m_client) {
    if ((flags & GREETING_VERDICT) != 0) {
      m_awaiting_verdict = true;  // the server's PROOF or REFUSAL decides
      return {};
    }
    if (keyed()) {
      return {.kind = Kind::NOT_ADMITTED, .text = "the server holds a key but gives no verdict"};
    }
    m_admitted = true;
    return {.kind = Kind::ADMIT};
  }
  if (keyed()) return {};  // the client's CHALLENGE and PROOF come next
  if (m_hook) return {.kind = Kind::DECIDE};
  m_admitted = true;
  return {.kind = Kind::ADMIT};
}

AdmissionStep AdmissionExchange::on_frame(AdmissionFrame frame,
                                          std::span<const std::uint8_t> body) {
  using Kind = AdmissionStep::Kind;
  const auto error = [](std::string text) {
    return AdmissionStep{.kind = Kind::PROTOCOL_ERROR, .text = std::move(text)};
  };
  if (m_admitted) return error(fmt::format("a {} frame after the set-up", to_string(frame)));
  switch (frame) {
    case AdmissionFrame::CHALLENGE: {
      if (!m_peer_keyed || m_peer) return error("an unexpected CHALLENGE frame");
      const auto nonce = decode_challenge(body);
      if (!nonce) {
        return error(fmt::format("a CHALLENGE frame of {} bytes ({} expected)", body.size(),
                                 ADMISSION_NONCE_SIZE));
      }
      m_peer = *nonce;
      if (!m_client) return {};
      const auto proof =
          m_key->prove(m_protocol, AdmissionRole::CLIENT, *m_peer, m_own, m_identity);
      return {.kind = Kind::SEND_PROOF, .proof = encode_proof(proof, m_identity)};
    }
    case AdmissionFrame::PROOF: {
      std::string problem;
      auto decoded = decode_proof(body, problem);
      if (!decoded) return error(problem);
      if (keyed() && (!m_peer || !decoded->proof)) {
        return error("a PROOF frame without a proof, or before a CHALLENGE");
      }
      if (m_client) {
        if (!m_awaiting_verdict) return error("an unexpected PROOF frame");
        if (keyed() && !m_key->verify(m_protocol, AdmissionRole::SERVER, m_own, *m_peer,
                                      decoded->identity, *decoded->proof)) {
          return {.kind = Kind::NOT_ADMITTED,
                  .text = "the server failed to prove the partition key"};
        }
        m_admitted = true;
        m_awaiting_verdict = false;
        return {.kind = Kind::ADMIT};
      }
      if (!keyed()) return error("a PROOF frame to a server without a key");
      if (!m_key->verify(m_protocol, AdmissionRole::CLIENT, m_own, *m_peer, decoded->identity,
                         *decoded->proof)) {
        return {.kind = Kind::NOT_ADMITTED,
                .text =
                    "the peer failed to prove the partition key (another key, or a replayed "
                    "set-up)"};
      }
      return {.kind = Kind::DECIDE, .identity = std::move(decoded->identity)};
    }
    case AdmissionFrame::REFUSAL:
      if (!m_client) return error("a REFUSAL frame from a client");
      return {.kind = Kind::REFUSED,
              .text = fmt::format("refused by the server: {}", decode_refusal(body))};
  }
  return error("an unknown admission frame");
}

std::optional<std::vector<std::uint8_t>> AdmissionExchange::verdict(std::uint16_t admission_minor) {
  m_admitted = true;
  if (!keyed() && m_peer_minor < admission_minor) return std::nullopt;
  std::optional<AdmissionProof> proof;
  if (keyed()) proof = m_key->prove(m_protocol, AdmissionRole::SERVER, *m_peer, m_own, m_identity);
  return encode_proof(proof, m_identity);
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
