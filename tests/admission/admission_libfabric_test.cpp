// Admission on libfabric (docs/admission.md): the connection data of a keyed set-up, written
// here independently of the library, played by raw libfabric endpoints on the tcp provider -
// a client that replays what it recorded, an older client, and a server that cannot prove the
// key.

#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <netinet/in.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../hostile/hostile_support.hpp"
#include "common/admission.hpp"

namespace netio3::hostile {
namespace {

using netio3::AcceptDecision;
using netio3::PeerInfo;
using netio3::RefusalCause;
using netio3::detail::AdmissionNonce;
using netio3::detail::AdmissionRole;
using netio3::detail::PartitionKey;

constexpr std::string_view KEY = "partition ATLAS-TDAQ-run-4711";
constexpr std::string_view OTHER_KEY = "partition ATLAS-TDAQ-run-0815";
constexpr std::string_view PROTOCOL = "libfabric";

// Connection data (24 bytes: "NIO3", version 1, flags, receive size, heartbeat token) and the
// admission flags.
constexpr std::uint16_t KEYED = 8;
constexpr std::uint16_t PROOF = 16;
constexpr std::uint16_t CHALLENGE = 32;
constexpr std::uint16_t NOT_ADMITTED = 64;
constexpr std::size_t CM_SIZE = 24;

void put_le64(std::uint8_t* p, std::uint64_t v) {
  for (unsigned i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8U * i));
}
std::uint64_t get_le64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (unsigned i = 0; i < 8; ++i) v |= std::uint64_t{p[i]} << (8U * i);
  return v;
}

Bytes cm_data(std::uint16_t flags, std::size_t size = CM_SIZE) {
  Bytes out(CM_SIZE, 0);
  std::memcpy(out.data(), "NIO3", 4);
  put_le16(out.data() + 4, 1);
  put_le16(out.data() + 6, flags);
  put_le64(out.data() + 8, 64 * 1024);
  out.resize(size);
  return out;
}
std::uint16_t flags_of(const Bytes& data) {
  return data.size() >= 8 ? static_cast<std::uint16_t>(data[6] | (data[7] << 8U)) : 0;
}
std::string text_after_cm(const Bytes& data) {
  return data.size() > CM_SIZE ? std::string(data.begin() + CM_SIZE, data.end()) : std::string{};
}

Bytes first_request(const AdmissionNonce& nonce, std::string_view identity) {
  Bytes out = cm_data(KEYED);
  append(out, nonce);
  out.push_back(static_cast<std::uint8_t>(identity.size()));
  out.insert(out.end(), identity.begin(), identity.end());
  return out;
}
struct ChallengeData {
  std::uint64_t id{};
  AdmissionNonce nonce{};
};
std::optional<ChallengeData> challenge_of(const Bytes& data) {
  if (data.size() != CM_SIZE + 24 || (flags_of(data) & CHALLENGE) == 0) return std::nullopt;
  ChallengeData out{.id = get_le64(data.data() + CM_SIZE)};
  std::copy_n(data.begin() + CM_SIZE + 8, 16, out.nonce.begin());
  return out;
}
Bytes second_request(std::uint64_t id, std::span<const std::uint8_t> proof) {
  Bytes out = cm_data(KEYED | PROOF);
  std::array<std::uint8_t, 8> id_bytes{};
  put_le64(id_bytes.data(), id);
  append(out, id_bytes);
  append(out, proof.first(16));
  return out;
}

// Raw libfabric endpoints (tcp provider) on one fabric, domain, event queue and completion
// queue: connect with any connection data, listen, accept or reject with any data.
class RawFabric {
 public:
  struct Event {
    enum class Kind { NONE, CONNECTED, CONNREQ, REJECTED, SHUTDOWN, ERROR } kind{Kind::NONE};
    Bytes data{};
    fi_info* request{nullptr};  // CONNREQ: answer it with accept() or reject()
  };

  RawFabric() {
    fi_info* hints = fi_allocinfo();
    hints->caps = FI_MSG;
    hints->ep_attr->type = FI_EP_MSG;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->fabric_attr->prov_name = ::strdup("tcp");
    m_hints = hints;
    fi_info* info = nullptr;
    if (fi_getinfo(FI_VERSION(1, 9), "127.0.0.1", nullptr, FI_SOURCE, m_hints, &info) != 0) return;
    m_info = info;
    fi_eq_attr eq_attr{};
    eq_attr.wait_obj = FI_WAIT_UNSPEC;
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    m_ok = fi_fabric(m_info->fabric_attr, &m_fabric, nullptr) == 0 &&
           fi_eq_open(m_fabric, &eq_attr, &m_eq, nullptr) == 0 &&
           fi_domain(m_fabric, m_info, &m_domain, nullptr) == 0 &&
           fi_cq_open(m_domain, &cq_attr, &m_cq, nullptr) == 0;
  }
  ~RawFabric() {
    for (auto it = m_eps.rbegin(); it != m_eps.rend(); ++it) fi_close(&(*it)->fid);
    if (m_pep != nullptr) fi_close(&m_pep->fid);
    if (m_cq != nullptr) fi_close(&m_cq->fid);
    if (m_domain != nullptr) fi_close(&m_domain->fid);
    if (m_eq != nullptr) fi_close(&m_eq->fid);
    if (m_fabric != nullptr) fi_close(&m_fabric->fid);
    if (m_info != nullptr) fi_freeinfo(m_info);
    if (m_hints != nullptr) fi_freeinfo(m_hints);
  }
  RawFabric(const RawFabric&) = delete;
  RawFabric& operator=(const RawFabric&) = delete;
  RawFabric(RawFabric&&) = delete;
  RawFabric& operator=(RawFabric&&) = delete;

  [[nodiscard]] bool ok() const { return m_ok; }

  // A new endpoint connects to `to` with `data`, from IP address `source` if one is given.
  bool connect(const EndPointAddress& to, const Bytes& data, const std::string& source = {}) {
    fi_info* info = nullptr;
    const std::string port = std::to_string(to.port);
    fi_info* hints = fi_dupinfo(m_hints);
    if (!source.empty()) {
      auto* sa = static_cast<sockaddr_in*>(std::calloc(1, sizeof(sockaddr_in)));  // NOLINT
      sa->sin_family = AF_INET;
      ::inet_pton(AF_INET, source.c_str(), &sa->sin_addr);
      hints->addr_format = FI_SOCKADDR_IN;
      hints->src_addr = sa;  // freed with the hints
      hints->src_addrlen = sizeof(sockaddr_in);
    }
    const int rc = fi_getinfo(FI_VERSION(1, 9), to.address.c_str(), port.c_str(), 0, hints, &info);
    fi_freeinfo(hints);
    if (rc != 0) return false;
    fid_ep* ep = open_ep(info);
    const bool ok = ep != nullptr && fi_connect(ep, info->dest_addr, data.data(), data.size()) == 0;
    fi_freeinfo(info);
    return ok;
  }

  // A message of `payload` (at most the provider's inject size) with remote CQ `data` on the
  // endpoint connected last.
  bool send_with_data(const Bytes& payload, std::uint64_t data) {
    if (m_eps.empty()) return false;
    for (;;) {
      const ssize_t rc = fi_injectdata(m_eps.back(), payload.data(), payload.size(), data, 0);
      if (rc != -FI_EAGAIN) return rc == 0;
      fi_cq_data_entry entry{};
      (void)fi_cq_read(m_cq, &entry, 1);  // drives the provider's progress
    }
  }

  // The event that ends a connect(): CONNECTED with the accept data, or REJECTED with the
  // reject data.
  Event outcome() {
    for (;;) {
      Event e = next();
      if (e.kind != Event::Kind::SHUTDOWN) return e;
    }
  }

  // The next connection request (what a closed connection reports before it is skipped).
  Event next_request() {
    for (;;) {
      Event e = next();
      if (e.kind != Event::Kind::SHUTDOWN && e.kind != Event::Kind::CONNECTED) return e;
    }
  }

  EndPointAddress listen() {
    if (fi_passive_ep(m_fabric, m_info, &m_pep, nullptr) != 0 ||
        fi_pep_bind(m_pep, &m_eq->fid, 0) != 0 || fi_listen(m_pep) != 0) {
      return {};
    }
    std::array<std::uint8_t, 128> name{};
    std::size_t len = name.size();
    if (fi_getname(&m_pep->fid, name.data(), &len) != 0) return {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(name.data());  // NOLINT
    return {"127.0.0.1", ntohs(in->sin_port)};
  }

  bool accept(fi_info* request, const Bytes& data) {
    fid_ep* ep = open_ep(request);
    const bool ok = ep != nullptr && fi_accept(ep, data.data(), data.size()) == 0;
    fi_freeinfo(request);
    return ok;
  }
  bool reject(fi_info* request, const Bytes& data) {
    const bool ok = fi_reject(m_pep, request->handle, data.data(), data.size()) == 0;
    fi_freeinfo(request);
    return ok;
  }

  // The next event queue entry within PROMPT (NONE when there was none).
  Event next() {
    const auto deadline = Clock::now() + PROMPT;
    alignas(fi_eq_cm_entry) std::array<std::uint8_t, sizeof(fi_eq_cm_entry) + 256> buffer{};
    while (Clock::now() < deadline) {
      std::uint32_t event = 0;
      const ssize_t rc = fi_eq_sread(m_eq, &event, buffer.data(), buffer.size(), 100, 0);
      if (rc == -FI_EAGAIN || rc == -FI_ETIMEDOUT) continue;
      if (rc == -FI_EAVAIL) {
        fi_eq_err_entry err{};
        if (fi_eq_readerr(m_eq, &err, 0) < 0) return {.kind = Event::Kind::ERROR};
        Event e{.kind = err.err == FI_ECONNREFUSED ? Event::Kind::REJECTED : Event::Kind::ERROR};
        if (err.err_data != nullptr) {
          const auto* p = static_cast<const std::uint8_t*>(err.err_data);
          e.data.assign(p, p + err.err_data_size);
        }
        return e;
      }
      if (rc < 0) return {.kind = Event::Kind::ERROR};
      const auto* entry = reinterpret_cast<const fi_eq_cm_entry*>(buffer.data());  // NOLINT
      Event e{};
      const std::size_t size = static_cast<std::size_t>(rc);
      if (size > sizeof(fi_eq_cm_entry))
        e.data.assign(entry->data, entry->data + (size - sizeof(fi_eq_cm_entry)));
      switch (event) {
        case FI_CONNECTED:
          e.kind = Event::Kind::CONNECTED;
          break;
        case FI_CONNREQ:
          e.kind = Event::Kind::CONNREQ;
          e.request = entry->info;
          break;
        case FI_SHUTDOWN:
          e.kind = Event::Kind::SHUTDOWN;
          break;
        default:
          e.kind = Event::Kind::ERROR;
          break;
      }
      return e;
    }
    return {};
  }

 private:
  fid_ep* open_ep(fi_info* info) {
    fid_ep* ep = nullptr;
    if (fi_endpoint(m_domain, info, &ep, nullptr) != 0) return nullptr;
    m_eps.push_back(ep);
    if (fi_ep_bind(ep, &m_eq->fid, 0) != 0 ||
        fi_ep_bind(ep, &m_cq->fid, FI_TRANSMIT | FI_RECV) != 0 || fi_enable(ep) != 0) {
      return nullptr;
    }
    return ep;
  }

  bool m_ok{false};
  fi_info* m_hints{nullptr};
  fi_info* m_info{nullptr};
  fid_fabric* m_fabric{nullptr};
  fid_eq* m_eq{nullptr};
  fid_domain* m_domain{nullptr};
  fid_cq* m_cq{nullptr};
  fid_pep* m_pep{nullptr};
  std::vector<fid_ep*> m_eps;
};

using Kind = RawFabric::Event::Kind;

// A netio3 libfabric server on the shared loop.
class AdmissionLibfabric : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!netio3::Netio3Backend::is_available(BackendType::LIBFABRIC)) {
      GTEST_SKIP() << "no libfabric backend";
    }
    m_server_rec.keep_data(false);
  }
  void TearDown() override {
    m_server.reset();
    m_loop.stop();
  }

  void start_server(std::string key, netio3::OnAcceptCb hook = {}, std::string identity = {}) {
    auto config = m_server_rec.config(netio3::ThreadSafetyModel::SAFE, NetworkMode::TCP);
    config.partition_key = std::move(key);
    config.identity = std::move(identity);
    config.on_accept_cb = std::move(hook);
    config.limits = patient_limits();
    m_server =
        netio3::Netio3Backend::create(BackendType::LIBFABRIC, std::move(config), m_loop.loop());
    m_listen = m_server->open_listen_endpoint({"127.0.0.1", 0}, listen_params());
    ASSERT_NE(m_listen.port, 0);
  }

  std::size_t server_count(Recorder::Kind kind) { return m_server_rec.count_now(kind); }

  LogCapture m_logs;
  Recorder m_server_rec;
  netio3::test::LoopThread m_loop;
  std::unique_ptr<NetworkBackend> m_server;
  EndPointAddress m_listen;
};

// An admitted peer on a listener with shared receive buffers tags its messages with tokens
// near its own - the token the server gave it, which names its connection - hoping for another
// connection's: none of them is delivered as that connection's (tokens were sequential ids, and
// its own token minus one named the connection accepted before it). Its own token still works.
TEST_F(AdmissionLibfabric, APeerTaggingMessagesWithAnotherConnectionsTokenIsNotBelieved) {
  auto config = m_server_rec.config(netio3::ThreadSafetyModel::SAFE, NetworkMode::TCP,
                                    Recorder::Callbacks::WITH_SENDER_AND_REASON);
  config.limits = patient_limits();
  m_server =
      netio3::Netio3Backend::create(BackendType::LIBFABRIC, std::move(config), m_loop.loop());
  m_listen = m_server->open_listen_endpoint(
      {"127.0.0.1", 0},
      {.recv_params = {.buf_size = 4096, .num_buf = 32, .use_shared_receive_buffers = true}});
  // The honest peer, connected first.
  Recorder honest_rec;
  auto honest = netio3::Netio3Backend::create(
      BackendType::LIBFABRIC, honest_rec.config(netio3::ThreadSafetyModel::SAFE, NetworkMode::TCP),
      m_loop.loop());
  honest->open_active_endpoint(m_listen, {.send_buffered_params = {.buf_size = 64, .num_buf = 4}});
  ASSERT_TRUE(
      honest_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
  ASSERT_TRUE(m_server_rec.wait(
      [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
  // The impostor: a raw endpoint that announces heartbeats, so that the server gives it its
  // token (and the tag flag: the listener's buffers are shared).
  constexpr std::uint16_t SENDS_HEARTBEATS = 2;
  constexpr std::uint16_t TAG_DATA = 4;
  RawFabric impostor;
  ASSERT_TRUE(impostor.ok());
  ASSERT_TRUE(impostor.connect(m_listen, cm_data(SENDS_HEARTBEATS)));
  const auto accepted = impostor.outcome();
  ASSERT_EQ(accepted.kind, Kind::CONNECTED);
  ASSERT_GE(accepted.data.size(), CM_SIZE);
  ASSERT_NE(flags_of(accepted.data) & TAG_DATA, 0) << "the server did not ask for tagged data";
  const std::uint64_t own = get_le64(accepted.data.data() + 16);
  ASSERT_NE(own, 0U);
  constexpr std::uint64_t TAG = std::uint64_t{1} << 63U;  // the tcp provider: 8 bytes of CQ data
  ASSERT_TRUE(m_server_rec.wait(
      [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 2; }));
  constexpr int NEAR = 64;
  for (int d = 1; d <= NEAR; ++d) {
    const auto delta = static_cast<std::uint64_t>(d);
    ASSERT_TRUE(impostor.send_with_data(Bytes{'s', 'p', 'o', 'o', 'f'}, (own - delta) | TAG));
    ASSERT_TRUE(impostor.send_with_data(Bytes{'s', 'p', 'o', 'o', 'f'}, (own + delta) | TAG));
  }
  ASSERT_TRUE(impostor.send_with_data(Bytes{'o', 'w', 'n'}, own | TAG));
  // The honest peer's own message last: once it is in, the impostor's (sent before, on
  // another connection) have long been read.
  NetworkBuffer* buffer = honest->get_buffer(m_listen);
  ASSERT_NE(buffer, nullptr);
  buffer->write(std::span<const std::uint8_t>{Bytes{'h', 'o', 'n', 'e', 's', 't'}});
  ASSERT_EQ(honest->send_buffer(m_listen, buffer), NetioStatus::OK);
  ASSERT_TRUE(m_server_rec.wait([](const Recorder& r) {
    return r.count(Recorder::Kind::DATA) >= 2;  // "own" and "honest"
  }));
  const auto events = m_server_rec.snapshot();
  std::size_t own_delivered = 0;
  std::vector<EndPointAddress> senders;
  for (const auto& e : events) {
    if (e.kind == Recorder::Kind::DATA) senders.push_back(e.remote);
  }
  // Two sources spoke: the honest one once, the impostor once (its own token).
  std::sort(senders.begin(), senders.end());
  EXPECT_EQ(std::unique(senders.begin(), senders.end()) - senders.begin(), 2);
  for (const auto& e : events) own_delivered += e.kind == Recorder::Kind::DATA && e.size == 3;
  EXPECT_EQ(own_delivered, 1U);
  EXPECT_EQ(m_server_rec.count_now(Recorder::Kind::DATA), 2U)
      << "a message tagged with a token near the impostor's was delivered";
  honest.reset();
}

// The whole set-up by hand; then each recorded request again, and made-up answers.
TEST_F(AdmissionLibfabric, RecordedRequestsReplayedAndMadeUpAnswersAreRefused) {
  ASSERT_NO_FATAL_FAILURE(start_server(std::string{KEY}, {}, "event-builder"));
  RawFabric raw;
  ASSERT_TRUE(raw.ok());
  const PartitionKey key{KEY};
  AdmissionNonce own{};
  own.fill(0x5A);

  const Bytes request = first_request(own, "ros-1");
  ASSERT_TRUE(raw.connect(m_listen, request));
  auto answer = raw.outcome();
  ASSERT_EQ(answer.kind, Kind::REJECTED) << m_logs.dump();
  const auto challenge = challenge_of(answer.data);
  ASSERT_TRUE(challenge.has_value()) << "a keyed request is answered with a challenge";
  const auto proof = key.prove(PROTOCOL, AdmissionRole::CLIENT, challenge->nonce, own, "ros-1");
  const Bytes answer_request = second_request(challenge->id, proof);
  ASSERT_TRUE(raw.connect(m_listen, answer_request));
  answer = raw.outcome();
  ASSERT_EQ(answer.kind, Kind::CONNECTED) << m_logs.dump();
  // The accept data: the server's short proof over our nonce and its identity.
  ASSERT_EQ(answer.data.size(), CM_SIZE + 16 + 1 + std::string_view{"event-builder"}.size());
  EXPECT_NE(flags_of(answer.data) & KEYED, 0);
  EXPECT_TRUE(key.verify(PROTOCOL, AdmissionRole::SERVER, own, challenge->nonce, "event-builder",
                         std::span{answer.data}.subspan(CM_SIZE, 16)));
  ASSERT_TRUE(m_server_rec.wait(
      [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));

  const auto refused_because = [&](const Bytes& data, std::string_view because) {
    if (!raw.connect(m_listen, data)) return ::testing::AssertionFailure() << "fi_connect failed";
    const auto e = raw.outcome();
    if (e.kind != Kind::REJECTED || (flags_of(e.data) & NOT_ADMITTED) == 0) {
      return ::testing::AssertionFailure() << "not refused as not admitted";
    }
    if (text_after_cm(e.data).find(because) == std::string::npos) {
      return ::testing::AssertionFailure() << "reason '" << text_after_cm(e.data) << "'";
    }
    return ::testing::AssertionSuccess();
  };
  // The answer again: its challenge was used.
  EXPECT_TRUE(refused_because(answer_request, "no pending challenge"));
  // The first request again: a new challenge, which the recorded answer does not meet.
  ASSERT_TRUE(raw.connect(m_listen, request));
  const auto again = raw.outcome();
  const auto second = challenge_of(again.data);
  ASSERT_TRUE(second.has_value());
  EXPECT_NE(second->id, challenge->id);
  EXPECT_NE(second->nonce, challenge->nonce);
  EXPECT_TRUE(
      refused_because(second_request(second->id, proof), "failed to prove the partition key"));
  // A made-up id, another key's proof, a short answer.
  EXPECT_TRUE(refused_because(second_request(challenge->id ^ 1U, proof), "no pending challenge"));
  ASSERT_TRUE(raw.connect(m_listen, request));
  const auto third = challenge_of(raw.outcome().data);
  ASSERT_TRUE(third.has_value());
  const PartitionKey other{OTHER_KEY};
  EXPECT_TRUE(refused_because(second_request(third->id, other.prove(PROTOCOL, AdmissionRole::CLIENT,
                                                                    third->nonce, own, "ros-1")),
                              "failed to prove the partition key"));
  EXPECT_TRUE(refused_because(head(answer_request, answer_request.size() - 1),
                              "an answer to a challenge of 23 bytes"));
  // Without the flag, or without anything behind the connection data.
  EXPECT_TRUE(refused_because(cm_data(0), "requires a partition key"));
  EXPECT_TRUE(refused_because(cm_data(KEYED), "no nonce and identity"));

  EXPECT_EQ(server_count(Recorder::Kind::ESTABLISHED), 1U);
  EXPECT_TRUE(m_logs.wait_line(m_listen, {"refusing connection", "no pending challenge"}));
}

// A message larger than the receive buffers the server announced is the peer's fault: the
// connection ends with CloseCause::PROTOCOL_ERROR and the reason (libfabric's truncated
// receive), and nothing of it is delivered.
TEST_F(AdmissionLibfabric, AMessageLargerThanTheReceiveBuffersIsAProtocolError) {
  auto config = m_server_rec.config(netio3::ThreadSafetyModel::SAFE, NetworkMode::TCP,
                                    Recorder::Callbacks::WITH_SENDER_AND_REASON);
  config.limits = patient_limits();
  m_server =
      netio3::Netio3Backend::create(BackendType::LIBFABRIC, std::move(config), m_loop.loop());
  m_listen = m_server->open_listen_endpoint({"127.0.0.1", 0},
                                            {.recv_params = {.buf_size = 32, .num_buf = 4}});
  RawFabric peer;
  ASSERT_TRUE(peer.ok());
  ASSERT_TRUE(peer.connect(m_listen, cm_data(0)));
  ASSERT_EQ(peer.outcome().kind, Kind::CONNECTED);
  ASSERT_TRUE(m_server_rec.wait(
      [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
  ASSERT_TRUE(peer.send_with_data(Bytes(100, 0x42), 0));  // 100 bytes into buffers of 32
  ASSERT_TRUE(
      m_server_rec.wait([](const Recorder& r) { return r.count(Recorder::Kind::CLOSED) == 1; }));
  EXPECT_EQ(m_server_rec.count_now(Recorder::Kind::DATA), 0U);
  for (const auto& e : m_server_rec.snapshot()) {
    if (e.kind != Recorder::Kind::CLOSED) continue;
    EXPECT_EQ(e.closed.cause, netio3::CloseCause::PROTOCOL_ERROR) << e.closed.message;
    EXPECT_NE(e.closed.message.find("larger than the receive buffers"), std::string::npos)
        << e.closed.message;
  }
}

// The challenge is bound to the address of the first request: a captured second request sent
// first from another address is refused and does not spend the challenge, so the real client,
// which sends it from its own address (a new endpoint, a new port), is still admitted. (It
// used to be the other way round: the copy admitted, the client refused.)
TEST_F(AdmissionLibfabric, AChallengeIsAnsweredOnlyFromTheAddressItWasIssuedTo) {
  ASSERT_NO_FATAL_FAILURE(start_server(std::string{KEY}, {}, "event-builder"));
  RawFabric raw;
  ASSERT_TRUE(raw.ok());
  const PartitionKey key{KEY};
  const AdmissionNonce own = netio3::detail::make_nonce();
  ASSERT_TRUE(raw.connect(m_listen, first_request(own, "ros-1"), "127.0.0.1"));
  const auto answer = raw.outcome();
  ASSERT_EQ(answer.kind, Kind::REJECTED) << m_logs.dump();
  const auto challenge = challenge_of(answer.data);
  ASSERT_TRUE(challenge.has_value());
  const Bytes proof = second_request(
      challenge->id, key.prove(PROTOCOL, AdmissionRole::CLIENT, challenge->nonce, own, "ros-1"));
  // The copy, from elsewhere.
  ASSERT_TRUE(raw.connect(m_listen, proof, "127.0.0.2"));
  const auto copy = raw.outcome();
  ASSERT_EQ(copy.kind, Kind::REJECTED) << "the copy from another address was admitted";
  EXPECT_NE(flags_of(copy.data) & NOT_ADMITTED, 0);
  EXPECT_NE(text_after_cm(copy.data).find("no pending challenge of its address"), std::string::npos)
      << text_after_cm(copy.data);
  // The client itself.
  ASSERT_TRUE(raw.connect(m_listen, proof, "127.0.0.1"));
  EXPECT_EQ(raw.outcome().kind, Kind::CONNECTED) << m_logs.dump();
  ASSERT_TRUE(m_server_rec.wait(
      [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
}

// A flood of first requests: the oldest challenge gives way at 1024 pending, the table does
// not grow, and a client that answers promptly is admitted.
TEST_F(AdmissionLibfabric, AFloodOfFirstRequestsDropsOnlyTheOldestChallenges) {
  ASSERT_NO_FATAL_FAILURE(start_server(std::string{KEY}));
  RawFabric raw;
  ASSERT_TRUE(raw.ok());
  const PartitionKey key{KEY};
  AdmissionNonce own{};
  own.fill(0x33);
  const Bytes request = first_request(own, "");
  std::vector<ChallengeData> challenges;
  for (int i = 0; i < 1025; ++i) {
    ASSERT_TRUE(raw.connect(m_listen, request)) << i;
    const auto c = challenge_of(raw.outcome().data);
    ASSERT_TRUE(c.has_value()) << i;
    challenges.push_back(*c);
  }
  const auto answer = [&](const ChallengeData& c) {
    raw.connect(m_listen,
                second_request(c.id, key.prove(PROTOCOL, AdmissionRole::CLIENT, c.nonce, own, "")));
    return raw.outcome().kind;
  };
  EXPECT_EQ(answer(challenges.front()), Kind::REJECTED) << "the oldest gave way";
  EXPECT_EQ(answer(challenges.back()), Kind::CONNECTED) << m_logs.dump();
  EXPECT_EQ(answer(challenges[1]), Kind::CONNECTED) << "the second oldest is still pending";
}

// An older netio3 client (16 or 24 bytes of connection data, no admission flags).
TEST_F(AdmissionLibfabric, AnOlderClientIsServedByAHookOnlyServerAndRefusedByAKeyedOne) {
  std::atomic<int> calls{0};
  ASSERT_NO_FATAL_FAILURE(start_server({}, [&](const PeerInfo& peer) {
    EXPECT_FALSE(peer.key_proven);
    EXPECT_EQ(peer.identity, "");
    return ++calls == 1 ? AcceptDecision::accept() : AcceptDecision::refuse("not you");
  }));
  RawFabric raw;
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE(raw.connect(m_listen, cm_data(0, 16)));
  auto e = raw.outcome();
  EXPECT_EQ(e.kind, Kind::CONNECTED) << m_logs.dump();
  EXPECT_EQ(e.data.size(), CM_SIZE) << "accept data as before admission";
  ASSERT_TRUE(raw.connect(m_listen, cm_data(0)));
  e = raw.outcome();
  EXPECT_EQ(e.kind, Kind::REJECTED);
  EXPECT_NE(flags_of(e.data) & NOT_ADMITTED, 0);
  EXPECT_EQ(text_after_cm(e.data), "not you");
  EXPECT_EQ(calls.load(), 2);

  m_server.reset();
  ASSERT_NO_FATAL_FAILURE(start_server(std::string{KEY}));
  ASSERT_TRUE(raw.connect(m_listen, cm_data(0, 16)));
  e = raw.outcome();
  EXPECT_EQ(e.kind, Kind::REJECTED);
  EXPECT_NE(flags_of(e.data) & NOT_ADMITTED, 0);
  EXPECT_NE(text_after_cm(e.data).find("requires a partition key"), std::string::npos);
}

// The hook closes its listener and opens one on the same port (the closed one's passive
// endpoint goes at once): the request of the old listener is refused either way, and the new
// listener serves.
TEST_F(AdmissionLibfabric, AListenerReopenedInsideTheHookTakesNoRequestOfTheOldOne) {
  std::atomic<int> calls{0};
  ASSERT_NO_FATAL_FAILURE(start_server({}, [&](const PeerInfo&) {
    const int n = ++calls;
    if (n <= 2) {
      m_server->close_listen_endpoint(m_listen);
      (void)m_server->open_listen_endpoint(m_listen, listen_params());
    }
    return n == 1 ? AcceptDecision::refuse("reopened") : AcceptDecision::accept();
  }));
  for (int i = 0; i < 3; ++i) {
    Recorder rec;
    auto config = rec.config(netio3::ThreadSafetyModel::SAFE, NetworkMode::TCP,
                             Recorder::Callbacks::WITH_SENDER_AND_REASON);
    config.limits = patient_limits();
    auto client =
        netio3::Netio3Backend::create(BackendType::LIBFABRIC, std::move(config), m_loop.loop());
    client->open_active_endpoint(m_listen, client_params());
    ASSERT_TRUE(rec.wait([](const Recorder& r) {
      return r.count(Recorder::Kind::ESTABLISHED) + r.count(Recorder::Kind::REFUSED) > 0;
    })) << m_logs.dump();
    EXPECT_EQ(rec.count_now(Recorder::Kind::ESTABLISHED), i == 2 ? 1U : 0U) << "client " << i;
  }
  EXPECT_EQ(calls.load(), 3);
  EXPECT_TRUE(m_server_rec.wait(
      [](const Recorder& r) { return r.count(Recorder::Kind::ESTABLISHED) == 1; }));
}

// A raw server plays what a listener without the key could do; the netio3 client refuses
// each, with the reason.
TEST_F(AdmissionLibfabric, AServerThatCannotProveTheKeyIsRefusedByTheClient) {
  RawFabric rogue;
  ASSERT_TRUE(rogue.ok());
  const EndPointAddress address = rogue.listen();
  ASSERT_NE(address.port, 0);
  Recorder rec;
  auto config = rec.config(netio3::ThreadSafetyModel::SAFE, NetworkMode::TCP,
                           Recorder::Callbacks::WITH_SENDER_AND_REASON);
  config.partition_key = std::string{KEY};
  config.identity = "ros-7";
  config.limits = patient_limits();
  auto client =
      netio3::Netio3Backend::create(BackendType::LIBFABRIC, std::move(config), m_loop.loop());
  const PartitionKey key{KEY};

  // How a client is refused: `serve` answers its requests.
  const auto refused_because = [&](const auto& serve, std::string_view because) {
    const std::size_t before = rec.count_now(Recorder::Kind::REFUSED);
    client->open_active_endpoint(address, client_params());
    serve();
    if (!rec.wait([&](const Recorder& r) { return r.count(Recorder::Kind::REFUSED) > before; })) {
      return ::testing::AssertionFailure() << "not refused";
    }
    const auto event = rec.snapshot().back();
    if (event.refusal.cause != RefusalCause::NOT_ADMITTED ||
        event.refusal.message.find(because) == std::string::npos) {
      return ::testing::AssertionFailure() << "refused: " << event.refusal.message;
    }
    return ::testing::AssertionSuccess();
  };
  AdmissionNonce client_nonce{};
  // Challenges the first request (checking it), then takes the second.
  const auto challenge_then = [&](const auto& on_second) {
    auto first = rogue.next_request();
    ASSERT_EQ(first.kind, Kind::CONNREQ);
    ASSERT_EQ(first.data.size(), CM_SIZE + 16 + 1 + 5);
    EXPECT_EQ(flags_of(first.data) & (KEYED | PROOF), KEYED);
    std::copy_n(first.data.begin() + CM_SIZE, 16, client_nonce.begin());
    EXPECT_EQ(std::string(first.data.end() - 5, first.data.end()), "ros-7");
    Bytes challenge = cm_data(CHALLENGE);
    std::array<std::uint8_t, 8> id{};
    put_le64(id.data(), 77);
    append(challenge, id);
    append(challenge, Bytes(16, 0x11));
    ASSERT_TRUE(rogue.reject(first.request, challenge));
    auto second = rogue.next();
    ASSERT_EQ(second.kind, Kind::CONNREQ);
    ASSERT_EQ(second.data.size(), CM_SIZE + 24);
    EXPECT_EQ(flags_of(second.data) & (KEYED | PROOF), KEYED | PROOF);
    EXPECT_EQ(get_le64(second.data.data() + CM_SIZE), 77U);
    AdmissionNonce server_nonce{};
    server_nonce.fill(0x11);
    EXPECT_TRUE(key.verify(PROTOCOL, AdmissionRole::CLIENT, server_nonce, client_nonce, "ros-7",
                           std::span{second.data}.subspan(CM_SIZE + 8, 16)))
        << "the client's proof";
    on_second(second.request);
  };
  // A proof of zeros.
  EXPECT_TRUE(refused_because(
      [&] {
        challenge_then([&](fi_info* request) {
          Bytes accept = cm_data(KEYED);
          append(accept, Bytes(17, 0));
          EXPECT_TRUE(rogue.accept(request, accept));
          // Progress is manual: reading the queue completes the accept.
          EXPECT_EQ(rogue.next().kind, Kind::CONNECTED);
        });
      },
      "the server failed to prove the partition key"));
  // Accepting without a challenge, as a server from before admission would.
  EXPECT_TRUE(refused_because(
      [&] {
        auto first = rogue.next_request();
        ASSERT_EQ(first.kind, Kind::CONNREQ);
        EXPECT_TRUE(rogue.accept(first.request, cm_data(0)));
        EXPECT_EQ(rogue.next().kind, Kind::CONNECTED);
      },
      "holds no partition key"));
  // A second challenge.
  EXPECT_TRUE(refused_because(
      [&] {
        challenge_then([&](fi_info* request) {
          Bytes challenge = cm_data(CHALLENGE);
          append(challenge, Bytes(24, 0x22));
          EXPECT_TRUE(rogue.reject(request, challenge));
        });
      },
      "another challenge"));
  EXPECT_EQ(rec.count_now(Recorder::Kind::ESTABLISHED), 0U);
  client.reset();
}

}  // namespace
}  // namespace netio3::hostile
