#include "backends/libfabric/fabric.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <netinet/in.h>
#include <stdexcept>
#include <string_view>
#include <sys/socket.h>

#include <fmt/format.h>

#include "common/byte_order.hpp"

namespace netio3::libfabric {
namespace {

constexpr std::array<std::uint8_t, 4> CM_MAGIC{'N', 'I', 'O', '3'};
constexpr std::uint16_t CM_VERSION = 1;
// Every endpoint of a domain reports into one queue: it must hold the completions of all
// their transmit and receive queues at once.
constexpr std::size_t CQ_SIZE = 16384;
constexpr std::size_t EQ_SIZE = 256;

[[noreturn]] void fail(std::string_view what, long rc) {
  throw std::runtime_error(fmt::format("{} failed: {}", what, fi_error(rc)));
}

void check(std::string_view what, long rc) {
  if (rc < 0) fail(what, rc);
}

}  // namespace

std::string fi_error(long rc) {
  return fmt::format("{} ({})", fi_strerror(static_cast<int>(rc < 0 ? -rc : rc)), rc);
}

ProviderChoice choose_provider(NetworkMode mode) {
  if (const char* env = std::getenv("FI_PROVIDER"); env != nullptr && *env != '\0') {
    return {env, true};
  }
  return {mode == NetworkMode::RDMA ? "verbs" : "tcp", false};
}

Info get_info(const ProviderChoice& provider, ThreadSafetyModel model,
              const EndPointAddress& address, bool local) {
  Info hints{fi_allocinfo()};
  if (!hints) throw std::runtime_error("fi_allocinfo failed");
  hints->ep_attr->type = FI_EP_MSG;
  hints->caps = FI_MSG | FI_SEND | FI_RECV;
  // Every operation context starts with a struct fi_context2, so both modes are honoured.
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  // What netio3 can do about registration: describe every local buffer (FI_MR_LOCAL),
  // register only allocated memory, take provider keys. FI_MR_ENDPOINT is not offered.
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading =
      model == ThreadSafetyModel::SAFE ? FI_THREAD_SAFE : FI_THREAD_DOMAIN;
  hints->domain_attr->data_progress = FI_PROGRESS_MANUAL;
  hints->domain_attr->control_progress = FI_PROGRESS_MANUAL;
  hints->addr_format =
      address.address.find(':') == std::string::npos ? FI_SOCKADDR_IN : FI_SOCKADDR_IN6;
  // The name goes into the hints also when it came from FI_PROVIDER: libfabric reads that
  // variable once per process, so a change after its first call would be ignored. A list
  // or an exclusion ("tcp,verbs", "^sockets") is left to libfabric's own filter.
  const bool plain_name = std::all_of(provider.name.begin(), provider.name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == ';';
  });
  if (plain_name) hints->fabric_attr->prov_name = ::strdup(provider.name.c_str());
  const std::string service = std::to_string(address.port);
  fi_info* info = nullptr;
  const int rc = fi_getinfo(API_VERSION, address.address.c_str(), service.c_str(),
                            local ? FI_SOURCE : 0, hints.get(), &info);
  if (rc != 0 || info == nullptr) {
    throw std::runtime_error(fmt::format("fi_getinfo for provider '{}'{} on {} ({}) failed: {}",
                                         provider.name,
                                         provider.from_environment ? " (from FI_PROVIDER)" : "",
                                         address, local ? "local" : "remote", fi_error(rc)));
  }
  return Info{info};
}

detail::Socket reserve_source_port(fi_info* info) {
  const std::string_view provider =
      info->fabric_attr != nullptr && info->fabric_attr->prov_name != nullptr
          ? info->fabric_attr->prov_name
          : "";
  const bool tcp = provider == "tcp" || provider == "net";
  const bool inet = info->addr_format == FI_SOCKADDR_IN || info->addr_format == FI_SOCKADDR_IN6;
  if (!tcp || !inet) return {};
  const int family = info->addr_format == FI_SOCKADDR_IN ? AF_INET : AF_INET6;
  const socklen_t length = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  if (info->src_addr == nullptr || info->src_addrlen < length) {
    // No source address from fi_getinfo: the wildcard (the kernel picks the interface at
    // connect). calloc: fi_freeinfo frees it with free().
    void* any = std::calloc(1, length);
    if (any == nullptr) throw std::runtime_error("no memory for a source address");
    static_cast<sockaddr*>(any)->sa_family = static_cast<sa_family_t>(family);
    std::free(info->src_addr);
    info->src_addr = any;
    info->src_addrlen = length;
  }
  auto* source = static_cast<sockaddr*>(info->src_addr);
  const auto set_port = [&](std::uint16_t port_be) {
    if (family == AF_INET) {
      reinterpret_cast<sockaddr_in*>(source)->sin_port = port_be;  // NOLINT
    } else {
      reinterpret_cast<sockaddr_in6*>(source)->sin6_port = port_be;  // NOLINT
    }
  };
  const auto fail = [](std::string_view step) {
    throw std::runtime_error(
        fmt::format("reserving a source port: {} failed: {}", step, std::strerror(errno)));
  };
  detail::Socket socket{::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  if (!socket.valid()) fail("socket");
  const int one = 1;
  if (::setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
    fail("SO_REUSEADDR");
  }
  const std::uint16_t port = detail::take_forced_source_port();  // 0 but in tests (tcp.hpp)
  set_port(htons(port));
  if (::bind(socket.get(), source, length) != 0) {
    if (errno != EADDRINUSE) fail("bind");
    // No port free: the provider's connect picks one (IP_BIND_ADDRESS_NO_PORT, port 0).
    set_port(0);
    detail::source_port_unavailable(port);
    return {};
  }
  sockaddr_storage bound{};
  socklen_t bound_length = sizeof(bound);
  if (::getsockname(socket.get(), reinterpret_cast<sockaddr*>(&bound), &bound_length) != 0) {
    fail("getsockname");
  }
  set_port(family == AF_INET ? reinterpret_cast<const sockaddr_in*>(&bound)->sin_port      // NOLINT
                             : reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port);  // NOLINT
  return socket;
}

std::array<std::uint8_t, CM_DATA_SIZE> encode_cm_data(const CmData& data) {
  std::array<std::uint8_t, CM_DATA_SIZE> out{};
  std::copy(CM_MAGIC.begin(), CM_MAGIC.end(), out.begin());
  detail::store_le16(out.data() + 4, CM_VERSION);
  detail::store_le16(out.data() + 6, data.flags);
  detail::store_le64(out.data() + 8, data.recv_buf_size);
  detail::store_le64(out.data() + 16, data.heartbeat_token);
  return out;
}

std::optional<CmData> decode_cm_data(std::span<const std::uint8_t> bytes, std::string& error) {
  if (bytes.size() < CM_DATA_MIN_SIZE) {
    error = fmt::format("connection data of {} bytes, a netio3 peer sends at least {}",
                        bytes.size(), CM_DATA_MIN_SIZE);
    return std::nullopt;
  }
  if (!std::equal(CM_MAGIC.begin(), CM_MAGIC.end(), bytes.begin())) {
    error = "connection data without the netio3 magic; the peer is not a netio3 libfabric backend";
    return std::nullopt;
  }
  const auto version = detail::load_le16(bytes.data() + 4);
  if (version != CM_VERSION) {
    error = fmt::format("connection data version {} (this side speaks {})", version, CM_VERSION);
    return std::nullopt;
  }
  return CmData{
      .recv_buf_size = detail::load_le64(bytes.data() + 8),
      .flags = detail::load_le16(bytes.data() + 6),
      .heartbeat_token = bytes.size() >= CM_DATA_SIZE ? detail::load_le64(bytes.data() + 16) : 0};
}

std::optional<std::size_t> cm_data_room(fid_t endpoint) noexcept {
  std::size_t size = 0;
  std::size_t len = sizeof size;
  if (fi_getopt(endpoint, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &size, &len) != 0) {
    return std::nullopt;
  }
  return size;
}

Domain::Domain(const fi_info& info) : m_info{fi_dupinfo(&info)} {
  if (!m_info) throw std::runtime_error("fi_dupinfo failed");
  fid_fabric* fabric = nullptr;
  check("fi_fabric", fi_fabric(m_info->fabric_attr, &fabric, nullptr));
  m_fabric.reset(fabric);

  fi_eq_attr eq_attr{};
  eq_attr.size = EQ_SIZE;
  eq_attr.wait_obj = FI_WAIT_FD;
  fid_eq* eq = nullptr;
  check("fi_eq_open", fi_eq_open(m_fabric.get(), &eq_attr, &eq, nullptr));
  m_eq.reset(eq);

  fid_domain* domain = nullptr;
  check("fi_domain", fi_domain(m_fabric.get(), m_info.get(), &domain, nullptr));
  m_domain.reset(domain);

  fi_cq_attr cq_attr{};
  cq_attr.size = CQ_SIZE;
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.wait_obj = FI_WAIT_FD;
  fid_cq* cq = nullptr;
  check("fi_cq_open", fi_cq_open(m_domain.get(), &cq_attr, &cq, nullptr));
  m_cq.reset(cq);

  check("fi_control(EQ, FI_GETWAIT)", fi_control(&m_eq->fid, FI_GETWAIT, &m_eq_fd));
  check("fi_control(CQ, FI_GETWAIT)", fi_control(&m_cq->fid, FI_GETWAIT, &m_cq_fd));
}

Domain::~Domain() {
  // Registrations before the domain, the queues before the domain and fabric.
  m_shared_mrs.clear();
  m_cq.reset();
  m_domain.reset();
  m_eq.reset();
  m_fabric.reset();
}

bool Domain::serves(const fi_info& info) const {
  const auto same = [](const char* a, const char* b) {
    return a != nullptr && b != nullptr && std::strcmp(a, b) == 0;
  };
  return same(m_info->fabric_attr->prov_name, info.fabric_attr->prov_name) &&
         same(m_info->fabric_attr->name, info.fabric_attr->name) &&
         same(m_info->domain_attr->name, info.domain_attr->name);
}

Fid<fid_mr> Domain::register_memory(std::span<std::uint8_t> region) const {
  // Without FI_MR_PROV_KEY the application picks the keys, and they must be unique.
  const bool provider_keys = (m_info->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0;
  const std::uint64_t key = provider_keys ? 0 : m_next_key.fetch_add(1);
  fid_mr* mr = nullptr;
  const int rc = fi_mr_reg(m_domain.get(), region.data(), region.size(), FI_SEND | FI_RECV, 0, key,
                           0, &mr, nullptr);
  if (rc != 0) {
    throw std::runtime_error(fmt::format("fi_mr_reg of {} bytes on provider '{}' failed: {}",
                                         region.size(), provider(), fi_error(rc)));
  }
  return Fid<fid_mr>{mr};
}

void* Domain::shared_registration(std::span<std::uint8_t> region) {
  const std::lock_guard lock{m_shared_mutex};
  auto& mr = m_shared_mrs[region.data()];
  if (!mr) mr = register_memory(region);
  return fi_mr_desc(mr.get());
}

}  // namespace netio3::libfabric
