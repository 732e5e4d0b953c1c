#pragma once

// libfabric plumbing for the libfabric backend: RAII for fids and fi_info, the provider
// choice, fi_getinfo for local and remote addresses, the connection-management data both
// sides exchange, and Domain (fabric + domain + one event queue + one completion queue,
// both with FI_WAIT_FD so the shared epoll loop can wait on them).

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <span>
#include <string>
#include <unordered_map>

#include <netio3/types.hpp>

#include "common/tcp.hpp"

namespace netio3::libfabric {

inline constexpr std::uint32_t API_VERSION = FI_VERSION(1, 9);

struct FidCloser {
  template <typename T>
  void operator()(T* p) const noexcept {
    if (p != nullptr) fi_close(&p->fid);
  }
};
template <typename T>
using Fid = std::unique_ptr<T, FidCloser>;

struct InfoDeleter {
  void operator()(fi_info* info) const noexcept { fi_freeinfo(info); }
};
using Info = std::unique_ptr<fi_info, InfoDeleter>;

// "Connection refused (-111)" style text for a libfabric return code (negative errno).
[[nodiscard]] std::string fi_error(long rc);

// The provider a NetworkMode selects: RDMA -> verbs, TCP -> tcp. FI_PROVIDER in the
// environment wins (then libfabric itself filters and the name here is only for messages).
struct ProviderChoice {
  std::string name;
  bool from_environment{false};
};
[[nodiscard]] ProviderChoice choose_provider(NetworkMode mode);

// fi_getinfo for FI_EP_MSG send/receive on `address`: as a local (listening) address with
// FI_SOURCE, or as the remote address to connect to. Throws std::runtime_error whose message
// names the provider and libfabric's reason.
[[nodiscard]] Info get_info(const ProviderChoice& provider, ThreadSafetyModel model,
                            const EndPointAddress& address, bool local);

// A source port of its own for the active endpoint `info` describes (issue 22: two connections
// of one process to two ports of one server could otherwise share one, and the server refuses
// the second). The tcp provider (libfabric 1.17, tcpx_ep.c) never binds an active socket to
// port 0: it binds to info->src_addr only with IP_BIND_ADDRESS_NO_PORT when that port is 0,
// which leaves the choice to connect(), and to the port given when it is not. So a socket of
// ours (SO_REUSEADDR, as the provider's) is bound to the source address with port 0 first,
// the kernel's port is written into info->src_addr, and the provider binds beside it. The
// returned socket holds the port until the endpoint has it: keep it open until fi_endpoint
// returned. Only for the tcp provider ("tcp", "net"; the sockets provider names a listener of
// its own per endpoint, unique already), or when no port is free (the provider's connect then
// picks one, detail::source_port_unavailable); an invalid socket otherwise. Throws
// std::runtime_error with the failing step.
[[nodiscard]] detail::Socket reserve_source_port(fi_info* info);

// Connection-management data, sent with fi_connect and fi_accept (24 bytes, little endian):
//   0..3 magic "NIO3", 4..5 version 1, 6..7 flags, 8..15 receive buffer size (0: the
//   endpoint cannot receive), 16..23 heartbeat token (0: none).
// A sender refuses messages larger than the peer's size.
// Flags: CM_REFUSED_ADDRESS_IN_USE, only in the data of fi_reject, says that the server has a
// connection from the client's source address and port already (docs/semantics.md), and the
// client retries from another source port. CM_SENDS_HEARTBEATS: this side sends heartbeats
// (common/liveness.hpp) to a peer that announced a token: empty messages with remote CQ data
// equal to that token (it names the connection also to a shared receive context).
// The first 16 bytes are all that netio3 before heartbeats sent and read: such a peer ignores
// the flag and the token (it gets no heartbeats and sends none), and its 16 bytes read as
// "no token, no heartbeats".
// CM_TAG_DATA: this side receives through a shared receive context, whose completions do not
// say which endpoint a message came from; the peer sends every data message with remote CQ
// data = its token with the top bit of the CQ data set (cq_tag_bit), so that the message is
// delivered with its connection (on_data_from_cb). Tokens stay below that bit. A peer that
// does not know the flag sends untagged data: delivered as from an unknown connection.
inline constexpr std::size_t CM_DATA_SIZE = 24;
inline constexpr std::size_t CM_DATA_MIN_SIZE = 16;
inline constexpr std::uint16_t CM_REFUSED_ADDRESS_IN_USE = 1;
inline constexpr std::uint16_t CM_SENDS_HEARTBEATS = 2;
inline constexpr std::uint16_t CM_TAG_DATA = 4;
// CM_GOODBYE: this side ends an orderly close (and its backend's destruction) with a goodbye
// to a peer that announced it and a token: a one-byte message with remote CQ data equal to the
// token (a heartbeat is empty); and a side that announced it and a token reads a peer's
// shutdown without a goodbye as a lost peer (a process that died: its kernel closes the
// socket in order), not as a close. An older peer counts a goodbye as a heartbeat.
inline constexpr std::uint16_t CM_GOODBYE = 128;
inline constexpr std::size_t GOODBYE_SIZE = 1;
// Delivery acknowledgement (DeliveryParameters): CM_ACKS, this side acknowledges deliveries
// when asked; CM_ACK_WANTED, it asks the peer to. Then the peer sends, at most once a round of
// its loop, an ACK_SIZE-byte message - the count (little endian) of this side's data messages
// it handed to its application - with remote CQ data equal to this side's token. Both sides
// need tokens (a side that asks gets receive buffers for it: ACK_RECEIVE_BUFFERS). A peer
// without CM_ACKS cannot be asked: the set-up fails.
inline constexpr std::uint16_t CM_ACKS = 256;
inline constexpr std::uint16_t CM_ACK_WANTED = 512;
inline constexpr std::size_t ACK_SIZE = 8;
inline constexpr RecvParameters ACK_RECEIVE_BUFFERS{.buf_size = 64, .num_buf = 4};
// Admission (docs/admission.md, backends/libfabric/admission.hpp): what follows the 24 bytes.
// CM_KEYED: in a request, the client holds a partition key (its nonce and identity follow, or
// with CM_PROOF its answer to a challenge); in the accept data, the server's short proof and
// identity follow. CM_CHALLENGE, in reject data: a challenge (its id and the server's nonce)
// follows; the client asks again with its proof. CM_NOT_ADMITTED, in reject data: the peer
// was not admitted, the reason (text) follows. A netio3 peer from before admission ignores
// these flags and the bytes behind the 24.
inline constexpr std::uint16_t CM_KEYED = 8;
inline constexpr std::uint16_t CM_PROOF = 16;
inline constexpr std::uint16_t CM_CHALLENGE = 32;
inline constexpr std::uint16_t CM_NOT_ADMITTED = 64;
// The bit of remote CQ data that marks a tagged data message (CM_TAG_DATA), for CQ data of
// `bytes` bytes (4 with verbs, 8 with tcp): the top one; a heartbeat's token never has it.
[[nodiscard]] constexpr std::uint64_t cq_tag_bit(std::size_t bytes) noexcept {
  return std::uint64_t{1} << (8 * std::min<std::size_t>(bytes, 8) - 1);
}
struct CmData {
  std::uint64_t recv_buf_size{};
  std::uint16_t flags{};
  std::uint64_t heartbeat_token{};
};
[[nodiscard]] std::array<std::uint8_t, CM_DATA_SIZE> encode_cm_data(const CmData& data);
// nullopt (and `error` set) for data that is not a netio3 peer's.
[[nodiscard]] std::optional<CmData> decode_cm_data(std::span<const std::uint8_t> bytes,
                                                   std::string& error);
// How many bytes of connection data the provider carries for an endpoint or a passive
// endpoint (FI_OPT_CM_DATA_SIZE); none when it does not say.
[[nodiscard]] std::optional<std::size_t> cm_data_room(fid_t endpoint) noexcept;

// One fabric + domain with an event queue (connection management) and a completion queue
// (all data transfers of every endpoint on it). Thread-safe as far as the provider's
// threading level is (FI_THREAD_SAFE for ThreadSafetyModel::SAFE).
class Domain {
 public:
  explicit Domain(const fi_info& info);
  Domain(const Domain&) = delete;
  Domain& operator=(const Domain&) = delete;
  Domain(Domain&&) = delete;
  Domain& operator=(Domain&&) = delete;
  ~Domain();

  // Same provider, fabric and domain: endpoints for `info` can be opened here.
  [[nodiscard]] bool serves(const fi_info& info) const;

  // Registers memory for local send/receive (honouring mr_mode: a unique requested key
  // unless the provider chooses keys). Throws std::runtime_error.
  [[nodiscard]] Fid<fid_mr> register_memory(std::span<std::uint8_t> region) const;
  // A registration kept until the domain closes (shared pools); returns its descriptor.
  [[nodiscard]] void* shared_registration(std::span<std::uint8_t> region);

  [[nodiscard]] const fi_info& info() const noexcept { return *m_info; }
  [[nodiscard]] fid_fabric* fabric() const noexcept { return m_fabric.get(); }
  [[nodiscard]] fid_domain* domain() const noexcept { return m_domain.get(); }
  [[nodiscard]] fid_eq* eq() const noexcept { return m_eq.get(); }
  [[nodiscard]] fid_cq* cq() const noexcept { return m_cq.get(); }
  [[nodiscard]] int eq_fd() const noexcept { return m_eq_fd; }
  [[nodiscard]] int cq_fd() const noexcept { return m_cq_fd; }
  [[nodiscard]] std::string_view provider() const noexcept {
    return m_info->fabric_attr->prov_name;
  }
  [[nodiscard]] std::size_t iov_limit() const noexcept { return m_info->tx_attr->iov_limit; }
  [[nodiscard]] std::size_t tx_depth() const noexcept { return m_info->tx_attr->size; }
  // Bytes of remote CQ data a message can carry (0: none).
  [[nodiscard]] std::size_t cq_data_size() const noexcept {
    return m_info->domain_attr->cq_data_size;
  }
  [[nodiscard]] bool has_shared_rx() const noexcept {
    return m_info->domain_attr->max_ep_srx_ctx > 0;
  }

  // Counts complete drains of the completion queue (read until empty); see the retirement
  // of closed connections in the backend.
  std::uint64_t drains{0};
  // Connections whose peer shut down (FI_SHUTDOWN), closed at the next complete drain of the
  // completion queue: what they received before the end of stream is in the queue ahead of
  // that point and is delivered first (loop thread only).
  std::vector<std::uint64_t> peer_shutdowns;
  // Wake-ups of the loop by this domain's wait fds with nothing behind them, in a row.
  std::uint64_t spurious_wakeups{0};
  // Out of descriptors (loop thread): the event queue is left out of the loop while
  // `eq_paused` (the backend's pause_if_short_of_descriptors).
  bool eq_paused{false};
  std::optional<detail::AcceptPauses> accept_pauses;
  // What the accept pauses' log lines name: the first listener on the domain (under the
  // backend's domain mutex).
  std::optional<EndPointAddress> first_listener;

 private:
  Info m_info;
  Fid<fid_fabric> m_fabric;
  Fid<fid_eq> m_eq;
  Fid<fid_domain> m_domain;
  Fid<fid_cq> m_cq;
  int m_eq_fd{-1};
  int m_cq_fd{-1};
  mutable std::atomic<std::uint64_t> m_next_key{1};
  std::mutex m_shared_mutex;
  std::unordered_map<const void*, Fid<fid_mr>> m_shared_mrs;
};

}  // namespace netio3::libfabric
