#include "backends/ucx/ucp.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <netinet/in.h>
#include <string>
#include <string_view>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <ucs/algorithm/crc.h>
#include <ucs/config/global_opts.h>
#include <unistd.h>
#include <utility>

#include <fmt/format.h>

#include "backends/ucx/tcp_wireup_guard.hpp"
#include "common/byte_order.hpp"
#include "common/log.hpp"

namespace netio3::ucx {

std::string status_text(ucs_status_t status) {
  return fmt::format("{} ({})", ucs_status_string(status), static_cast<int>(status));
}

UcxError::UcxError(std::string_view what, ucs_status_t status)
    : std::runtime_error{fmt::format("{} failed: {}", what, status_text(status))},
      m_status{status} {}

TransportChoice choose_transports(NetworkMode mode) {
  if (const char* env = std::getenv("UCX_TLS"); env != nullptr && *env != '\0') {
    return {env, true};
  }
  return {mode == NetworkMode::TCP ? "tcp" : std::string{RDMA_TRANSPORTS}, false};
}

namespace {

// Whether a UCX_TLS value may select one of the transports `names` (the transport and the
// aliases that include it). "" and "all" select every one, a leading '^' excludes the ones
// listed.
bool may_use(std::string_view tls, std::initializer_list<std::string_view> names) {
  const auto listed = [](std::string_view list, auto&& wanted) {
    for (std::string_view rest = list; !rest.empty();) {
      const auto comma = rest.find(',');
      if (wanted(rest.substr(0, comma))) return true;
      rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    }
    return false;
  };
  const auto named = [&](std::string_view item) {
    return std::find(names.begin(), names.end(), item) != names.end();
  };
  if (tls.starts_with('^')) return !listed(tls.substr(1), named);
  return tls.empty() || listed(tls, named) ||
         listed(tls, [](std::string_view item) { return item == "all"; });
}

bool env_set(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && *env != '\0';
}

// UCX 1.13 allows UCX_ASYNC_MAX_EVENTS (default 1024) handlers on its async thread in one
// process: one per listener and one per connection-manager endpoint (each a descriptor). At
// the limit it does not refuse an incoming connection cleanly: it asserts
// (tcp_sockcm_ep.c:189) or crashes in its async thread. Unless UCX_ASYNC_MAX_EVENTS is set,
// the limit is raised to the process's descriptor limit (at most ASYNC_EVENTS_CAP), so that
// descriptors run out first. Only ever raised; it also sizes each new worker's queue of
// missed async events (a few bytes an entry: at most 256 KiB at the cap).
constexpr rlim_t ASYNC_EVENTS_CAP = rlim_t{1} << 16;

void raise_async_handler_limit() {
  static std::mutex mutex;
  const std::lock_guard lock{mutex};
  if (const char* env = std::getenv("UCX_ASYNC_MAX_EVENTS"); env != nullptr && *env != '\0') {
    return;
  }
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t want = std::min(limit.rlim_cur, ASYNC_EVENTS_CAP);  // RLIM_INFINITY is larger
  if (want <= ucs_global_opts.async_max_events) return;
  const std::string value = std::to_string(want);
  const ucs_status_t status = ucs_global_opts_set_value("ASYNC_MAX_EVENTS", value.c_str());
  if (status != UCS_OK) {
    NETIO3_WARN("ucx: cannot raise UCX's async handler limit from {} to {}: {}",
                ucs_global_opts.async_max_events, value, status_text(status));
    return;
  }
  NETIO3_DEBUG("ucx: UCX's async handler limit raised to {} (RLIMIT_NOFILE)", value);
}

struct ConfigDeleter {
  void operator()(ucp_config_t* config) const noexcept { ucp_config_release(config); }
};

}  // namespace

Worker::Worker(const TransportChoice& transports, ThreadSafetyModel model,
               const std::string& devices) {
  raise_async_handler_limit();
  ucp_config_t* raw = nullptr;
  check("ucp_config_read", ucp_config_read(nullptr, nullptr, &raw));
  const std::unique_ptr<ucp_config_t, ConfigDeleter> config{raw};
  // The environment has been read into the configuration already; only a choice of our
  // own is written over it.
  if (!transports.from_environment && !transports.tls.empty()) {
    check("ucp_config_modify(TLS)", ucp_config_modify(config.get(), "TLS", transports.tls.c_str()));
  }
  if (const char* env = std::getenv("UCX_NET_DEVICES");
      (env == nullptr || *env == '\0') && !devices.empty()) {
    check("ucp_config_modify(NET_DEVICES)",
          ucp_config_modify(config.get(), "NET_DEVICES", devices.c_str()));
  }
  // UCX 1.13's tcp transport aborts (tcp_ep.c:939, PUT_TX_WAITING_ACK) when a PUT
  // acknowledgement arrives after its endpoint's sends were cancelled, as happens when a
  // peer closes during rendezvous traffic: rendezvous over tcp then goes by active messages
  // instead of PUT. UCX_TCP_PUT_ENABLE in the environment still decides. The key is the tcp
  // transport's own (UCX hands keys it does not know to every transport it opens, and warns
  // if none takes it: so only where tcp may be among them).
  if (!env_set("UCX_TCP_PUT_ENABLE") && may_use(transports.tls, {"tcp"})) {
    check("ucp_config_modify(PUT_ENABLE)", ucp_config_modify(config.get(), "PUT_ENABLE", "n"));
  }
  // Endpoints are made with peer error handling, and UCX 1.13's shared-memory transports
  // (posix, sysv) offer it only when asked to: without this, processes of one host talk over
  // tcp. The key is theirs alone; UCX_{POSIX,SYSV}_ERROR_HANDLING in the environment decide.
  if (!env_set("UCX_POSIX_ERROR_HANDLING") && !env_set("UCX_SYSV_ERROR_HANDLING") &&
      may_use(transports.tls, {"posix", "sysv", "mm", "sm", "shm"})) {
    check("ucp_config_modify(MM_ERROR_HANDLING)",
          ucp_config_modify(config.get(), "MM_ERROR_HANDLING", "y"));
  }
  // Under peer error handling UCX 1.13 gives rendezvous lanes only to memory domains that
  // can invalidate a registration. CMA's registration is a no-op (it reads the peer's
  // memory with process_vm_readv), and its MEMORY_INVALIDATE switch only says so: a
  // rendezvous send pending when its endpoint fails then completes once, with an error
  // (ucp_request_dt_invalidate), which is what netio3 reports anyway. Without it, large
  // messages between processes of one host go as fragments over tcp. The key is the CMA
  // memory domain's own (so only where cma may be among the transports);
  // UCX_CMA_MEMORY_INVALIDATE in the environment decides.
  if (!env_set("UCX_CMA_MEMORY_INVALIDATE") &&
      may_use(transports.tls, {"cma", "sm", "shm", "scopy"})) {
    check("ucp_config_modify(MEMORY_INVALIDATE)",
          ucp_config_modify(config.get(), "MEMORY_INVALIDATE", "y"));
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  check("ucp_init", ucp_init(&params, config.get(), &m_context));
  try {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode =
        model == ThreadSafetyModel::SAFE ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SINGLE;
    const std::uint64_t guarded = tcp_wireup_guarded_interfaces();
    check("ucp_worker_create", ucp_worker_create(m_context, &wp, &m_worker));
    m_tcp_guarded = tcp_wireup_guarded_interfaces() > guarded;
    if (!m_tcp_guarded && tcp_wireup_guard_wanted() && may_use(transports.tls, {"tcp"})) {
      static std::atomic<bool> said{false};
      if (!said.exchange(true)) {
        NETIO3_WARN(
            "ucx: the guard against UCX 1.13's tcp wire-up crash is not in effect (UCP does not "
            "call netio3's uct_iface_set_am_handler: was libnetio3 loaded after libuct?); a "
            "process that reaches a UCX tcp port of this one can crash it (docs/ucx.md)");
      }
    }
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
    check("ucp_worker_query", ucp_worker_query(m_worker, &attr));
    if (model == ThreadSafetyModel::SAFE && attr.thread_mode != UCS_THREAD_MODE_MULTI) {
      throw std::runtime_error(
          "ucp_worker_create: this UCX was built without multi-thread support, which "
          "ThreadSafetyModel::SAFE needs");
    }
    check("ucp_worker_get_efd", ucp_worker_get_efd(m_worker, &m_efd));
    ucp_address_t* address = nullptr;
    std::size_t length = 0;
    check("ucp_worker_get_address", ucp_worker_get_address(m_worker, &address, &length));
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(address);  // NOLINT
    m_address.assign(bytes, bytes + length);
    ucp_worker_release_address(m_worker, address);
  } catch (...) {
    if (m_worker != nullptr) ucp_worker_destroy(m_worker);
    ucp_cleanup(m_context);
    throw;
  }
}

Worker::~Worker() {
  ucp_worker_destroy(m_worker);
  ucp_cleanup(m_context);
}

MemoryMap::MemoryMap(ucp_context_h context, std::span<std::uint8_t> region) : m_context{context} {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = region.data();
  params.length = region.size();
  check("ucp_mem_map", ucp_mem_map(context, &params, &m_memh));
}

MemoryMap::MemoryMap(MemoryMap&& other) noexcept
    : m_context{std::exchange(other.m_context, nullptr)},
      m_memh{std::exchange(other.m_memh, nullptr)} {}

MemoryMap& MemoryMap::operator=(MemoryMap&& other) noexcept {
  if (this != &other) {
    reset();
    m_context = std::exchange(other.m_context, nullptr);
    m_memh = std::exchange(other.m_memh, nullptr);
  }
  return *this;
}

MemoryMap::~MemoryMap() {
  reset();
}

void MemoryMap::reset() noexcept {
  if (m_memh != nullptr) ucp_mem_unmap(m_context, m_memh);
  m_memh = nullptr;
}

namespace {

// A transport's attributes in a worker address, as UCX's lane selection reads them: its
// scores must come out as positive numbers (a NaN made UCX assert, select.c:294).
std::string check_iface_attr(std::span<const std::uint8_t> attr, bool v2) {
  if (v2) {
    // overhead, bandwidth, latency: 8-bit floats whose exponent 15 is NaN; then priority,
    // segment size (16 bits), flags.
    for (std::size_t i = 0; i < 3; ++i) {
      if ((attr[i] & 0x0FU) == 0x0FU) return "a performance figure that is not a number";
    }
    if ((attr[4] | attr[5]) == 0) return "a segment size of 0";
    return {};
  }
  // overhead, bandwidth, latency overhead: floats (a negative bandwidth is a shared one).
  for (std::size_t i = 0; i < 3; ++i) {
    float value = 0;
    std::memcpy(&value, attr.data() + 4 * i, sizeof(value));
    if (!std::isfinite(value) || (i != 1 && value < 0) || (i == 1 && value == 0)) {
      return "a performance figure out of range";
    }
  }
  return {};
}

std::string walk_worker_address(std::span<const std::uint8_t> address, WorkerAddressInfo& info);

}  // namespace

WorkerAddressInfo parse_worker_address(std::span<const std::uint8_t> address) {
  WorkerAddressInfo info;
  info.error = walk_worker_address(address, info);
  return info;
}

namespace {
std::string walk_worker_address(std::span<const std::uint8_t> address, WorkerAddressInfo& info) {
  // Layout and limits of UCX 1.13 (src/ucp/wireup/address.c, ucp_types.h).
  constexpr unsigned VERSION_1 = 0;
  constexpr unsigned VERSION_2 = 1;
  constexpr std::uint8_t HEADER_DEBUG_INFO = 1U << 0U;
  constexpr std::uint8_t HEADER_WORKER_UUID = 1U << 1U;
  constexpr std::uint8_t HEADER_CLIENT_ID = 1U << 2U;
  constexpr std::uint8_t HEADER_AM_ONLY = 1U << 3U;
  constexpr std::uint8_t NULL_RESOURCE = 0xFF;
  constexpr std::uint8_t MD_EMPTY_DEV = 0x80;
  constexpr std::uint8_t MD_MASK_V1 = 0x1F;
  constexpr std::uint8_t MD_MASK_V2 = 0x7F;
  constexpr std::uint8_t FLAG_LAST = 0x80;
  constexpr std::uint8_t DEVICE_NUM_PATHS = 0x40;
  constexpr std::uint8_t DEVICE_SYS_DEVICE = 0x20;
  constexpr std::uint8_t DEVICE_LEN_MASK = 0x1F;
  constexpr std::uint8_t IFACE_HAS_EP_ADDR = 0x40;
  constexpr std::uint8_t IFACE_LEN_MASK = 0x3F;
  constexpr std::size_t TL_NAME_CSUM = 2;
  constexpr std::size_t IFACE_ATTR_V1 = 16;
  constexpr std::size_t IFACE_ATTR_V2 = 8;
  constexpr std::size_t MAX_MDS = 64;
  constexpr std::size_t MAX_RESOURCES = 128;

  if (const char* unified = std::getenv("UCX_UNIFIED_MODE");
      unified != nullptr && (*unified == 'y' || *unified == 'Y' || *unified == '1')) {
    return "UCX_UNIFIED_MODE is set: worker addresses of that mode cannot be checked";
  }
  std::size_t pos = 0;
  const auto need = [&](std::size_t n) {
    return address.size() - std::min(pos, address.size()) >= n;
  };
  const auto byte = [&] { return address[pos++]; };
  if (!need(1)) return "an empty worker address";
  const std::uint8_t header = byte();
  const unsigned version = header & 0x0FU;
  std::uint8_t flags = 0;
  if (version == VERSION_1) {
    flags = static_cast<std::uint8_t>(header >> 4U);
  } else if (version == VERSION_2) {
    if (!need(1)) return "a worker address cut short in its header";
    flags = byte();
  } else {
    return fmt::format("a worker address of format version {} (UCX knows 0 and 1)", version);
  }
  if ((flags & ~(HEADER_DEBUG_INFO | HEADER_WORKER_UUID | HEADER_CLIENT_ID | HEADER_AM_ONLY)) !=
      0) {
    return fmt::format("a worker address with unknown flags {:#x}", flags);
  }
  const bool v2 = version == VERSION_2;
  // An extended byte: the value in the masked bits, or the next byte when they are all set.
  const auto extended = [&](std::uint8_t mask, std::size_t& value) {
    value = address[pos++] & mask;
    if (v2 && value == mask) {
      if (!need(1)) return false;
      value = address[pos++];
    }
    return true;
  };
  if (!v2 || (flags & HEADER_WORKER_UUID) != 0) {
    if (!need(8)) return "a worker address cut short in its id";
    info.uuid = detail::load_le64(address.data() + pos);
    pos += 8;
  }
  if ((flags & HEADER_CLIENT_ID) != 0) pos += 8;
  if ((flags & HEADER_DEBUG_INFO) != 0) {
    if (!need(1)) return "a worker address cut short before its name";
    pos += 1 + address[pos];
  }
  if (!need(1)) return "a worker address cut short before its devices";
  if (address[pos] == NULL_RESOURCE) {
    return pos + 1 == address.size() ? std::string{} : "bytes after an empty worker address";
  }
  std::size_t entries = 0;
  for (bool last_device = false; !last_device;) {
    if (!need(2)) return "a worker address cut short in a device";
    const bool empty = (address[pos] & MD_EMPTY_DEV) != 0;
    std::size_t md_index = 0;
    if (!extended(v2 ? MD_MASK_V2 : MD_MASK_V1, md_index) || !need(1)) {
      return "a worker address cut short in a device";
    }
    if (md_index >= MAX_MDS) return fmt::format("a worker address with memory domain {}", md_index);
    const std::uint8_t device_flags = address[pos] & static_cast<std::uint8_t>(~DEVICE_LEN_MASK);
    last_device = (device_flags & FLAG_LAST) != 0;
    std::size_t device_length = 0;
    if (!extended(DEVICE_LEN_MASK, device_length)) return "a worker address cut short in a device";
    if ((device_flags & DEVICE_NUM_PATHS) != 0) {
      if (!need(1) || byte() == 0) return "a worker address with a device of 0 paths";
    }
    if ((device_flags & DEVICE_SYS_DEVICE) != 0) ++pos;
    const std::size_t device_at = pos;
    pos += device_length;
    if (pos > address.size()) return "a worker address cut short in a device address";
    for (bool last_iface = empty; !last_iface;) {
      if (++entries > MAX_RESOURCES) return "a worker address with too many transports";
      if (!need(TL_NAME_CSUM)) return "a worker address cut short in a transport";
      const std::size_t name_at = pos;
      const std::uint16_t checksum = detail::load_le16(address.data() + pos);
      pos += TL_NAME_CSUM;
      if (!need(v2 ? IFACE_ATTR_V2 : IFACE_ATTR_V1)) {
        return "a worker address cut short in a transport";
      }
      if (const auto bad = check_iface_attr(address.subspan(pos), v2); !bad.empty()) {
        return fmt::format("a worker address whose transport {} has {}", entries, bad);
      }
      pos += v2 ? IFACE_ATTR_V2 : IFACE_ATTR_V1;
      if (!need(1)) return "a worker address cut short in a transport";
      const std::uint8_t iface_flags = address[pos];
      last_iface = (iface_flags & FLAG_LAST) != 0;
      std::size_t iface_length = 0;
      if (!extended(IFACE_LEN_MASK, iface_length))
        return "a worker address cut short in a transport";
      const std::size_t iface_at = pos;
      pos += iface_length;
      if (pos <= address.size()) {
        info.transports.push_back({checksum, address.subspan(device_at, device_length),
                                   address.subspan(iface_at, iface_length), name_at});
      }
      // Endpoint addresses travel in UCX's wireup messages, never in a worker address.
      if ((iface_flags & IFACE_HAS_EP_ADDR) != 0) return "a worker address with endpoint addresses";
      if (pos > address.size()) return "a worker address cut short in a transport address";
    }
  }
  if (pos != address.size()) {
    return fmt::format("{} bytes after the end of the worker address", address.size() - pos);
  }
  return {};
}
}  // namespace

bool impersonates(const WorkerAddressInfo& peer, const WorkerAddressInfo& own) {
  if (peer.uuid == own.uuid) return false;
  // Only the tcp transport's address (a listening port) names one worker; shared-memory and
  // CMA addresses are per process, the same for every worker of it.
  static const std::uint16_t tcp = ucs_crc16_string("tcp");
  const auto same = [](std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  };
  for (const auto& theirs : peer.transports) {
    for (const auto& ours : own.transports) {
      if (theirs.name_checksum == tcp && ours.name_checksum == tcp &&
          same(theirs.device, ours.device) && same(theirs.iface, ours.iface) &&
          !theirs.iface.empty()) {
        return true;
      }
    }
  }
  return false;
}

std::array<std::uint8_t, AM_HEADER_SIZE> encode_header(const AmHeader& header) {
  std::array<std::uint8_t, AM_HEADER_SIZE> out{};
  out[0] = static_cast<std::uint8_t>(header.type);
  out[1] = PROTOCOL_VERSION;
  out[2] = header.prefix_len;
  detail::store_le64(out.data() + 8, header.seq);
  detail::store_le64(out.data() + 16, header.token);
  return out;
}

std::optional<AmHeader> decode_header(std::span<const std::uint8_t> bytes, std::string& error) {
  if (bytes.size() < AM_HEADER_SIZE) {
    error = fmt::format("message header of {} bytes (expected at least {})", bytes.size(),
                        AM_HEADER_SIZE);
    return std::nullopt;
  }
  if (bytes[1] != PROTOCOL_VERSION) {
    error = fmt::format("protocol version {} (this side speaks {})", bytes[1], PROTOCOL_VERSION);
    return std::nullopt;
  }
  if (std::any_of(bytes.begin() + 3, bytes.begin() + 8, [](std::uint8_t b) { return b != 0; })) {
    error = "non-zero reserved bytes in the message header";
    return std::nullopt;
  }
  const std::uint8_t prefix = bytes[2];
  if (prefix > AM_PREFIX_MAX || bytes.size() != AM_HEADER_SIZE + prefix) {
    error = fmt::format("message header of {} bytes with a prefix of {} (at most {})", bytes.size(),
                        prefix, AM_PREFIX_MAX);
    return std::nullopt;
  }
  const auto type = static_cast<MessageType>(bytes[0]);
  switch (type) {
    case MessageType::BYE:
    case MessageType::READY:
      if (prefix != 0) {
        error = fmt::format("a prefix of {} bytes on a {} message", prefix,
                            type == MessageType::BYE ? "BYE" : "READY");
        return std::nullopt;
      }
      [[fallthrough]];
    case MessageType::ACK:
      if (type == MessageType::ACK && prefix != ACK_PREFIX_SIZE) {
        error = fmt::format("an ACK message with a prefix of {} bytes (expected {})", prefix,
                            ACK_PREFIX_SIZE);
        return std::nullopt;
      }
      [[fallthrough]];
    case MessageType::DATA:
      return AmHeader{type, detail::load_le64(bytes.data() + 8), prefix,
                      detail::load_le64(bytes.data() + 16)};
  }
  error = fmt::format("unknown message type {}", bytes[0]);
  return std::nullopt;
}

detail::Greeting control_greeting(std::uint64_t max_message_size, std::uint32_t flags) {
  return detail::Greeting{.major = CONTROL_PROTOCOL.major,
                          .minor = CONTROL_PROTOCOL.minor,
                          .max_message_size = static_cast<std::uint32_t>(std::clamp<std::uint64_t>(
                              max_message_size, 1, detail::WIRE_MAX_MESSAGE_SIZE)),
                          .flags = flags};
}

std::vector<std::uint8_t> encode_control_greeting(std::uint64_t max_message_size,
                                                  std::uint32_t flags) {
  const auto g = detail::encode_greeting(control_greeting(max_message_size, flags));
  return {g.begin(), g.end()};
}

std::vector<std::uint8_t> encode_hello_frame(const Hello& hello) {
  const std::size_t body = HELLO_FIXED_SIZE + hello.worker_address.size();
  std::vector<std::uint8_t> out(detail::FRAME_HEADER_SIZE + body, 0);
  detail::encode_frame_header(out.data(), static_cast<std::uint32_t>(body), FRAME_HELLO);
  std::uint8_t* p = out.data() + detail::FRAME_HEADER_SIZE;
  p[0] = BACKEND_UCX;
  p[1] = hello.mode;
  detail::store_le64(p + 8, hello.max_message_size);
  detail::store_le64(p + 16, hello.token);
  std::copy(hello.worker_address.begin(), hello.worker_address.end(), p + HELLO_FIXED_SIZE);
  return out;
}

std::vector<std::uint8_t> encode_opening(const Hello& hello) {
  auto out = encode_control_greeting(hello.max_message_size, 0);
  const auto frame = encode_hello_frame(hello);
  out.insert(out.end(), frame.begin(), frame.end());
  return out;
}

std::optional<Hello> decode_hello(std::span<const std::uint8_t> bytes, std::string& error) {
  if (bytes.size() <= HELLO_FIXED_SIZE) {
    error = fmt::format("HELLO of {} bytes (at least {} and a worker address)", bytes.size(),
                        HELLO_FIXED_SIZE);
    return std::nullopt;
  }
  if (bytes[0] != BACKEND_UCX) {
    error = fmt::format("HELLO names backend type {} (this is a ucx backend, type {})", bytes[0],
                        BACKEND_UCX);
    return std::nullopt;
  }
  if (bytes[1] > 1 ||
      std::any_of(bytes.begin() + 2, bytes.begin() + 8, [](std::uint8_t b) { return b != 0; })) {
    error = "HELLO with an unknown network mode or non-zero reserved bytes";
    return std::nullopt;
  }
  Hello hello{.mode = bytes[1],
              .max_message_size = detail::load_le64(bytes.data() + 8),
              .token = detail::load_le64(bytes.data() + 16),
              .worker_address = bytes.subspan(HELLO_FIXED_SIZE)};
  if (hello.max_message_size == 0) {
    error = "HELLO announces a maximum message size of 0";
    return std::nullopt;
  }
  if (hello.token == 0) {
    error = "HELLO with connection token 0";
    return std::nullopt;
  }
  if (hello.worker_address.size() > MAX_WORKER_ADDRESS) {
    error = fmt::format("HELLO with a worker address of {} bytes (at most {})",
                        hello.worker_address.size(), MAX_WORKER_ADDRESS);
    return std::nullopt;
  }
  return hello;
}

std::array<std::uint8_t, detail::FRAME_HEADER_SIZE + CLOSE_SIZE> encode_close(std::uint64_t sent) {
  std::array<std::uint8_t, detail::FRAME_HEADER_SIZE + CLOSE_SIZE> out{};
  detail::encode_frame_header(out.data(), CLOSE_SIZE, FRAME_CLOSE);
  detail::store_le64(out.data() + detail::FRAME_HEADER_SIZE, sent);
  return out;
}

std::optional<std::uint64_t> decode_close(std::span<const std::uint8_t> bytes) {
  if (bytes.size() != CLOSE_SIZE) return std::nullopt;
  return detail::load_le64(bytes.data());
}

std::uint16_t cma_checksum() {
  static const std::uint16_t cma = ucs_crc16_string("cma");
  return cma;
}

namespace {

// What the kernel's ptrace access check (__ptrace_may_access, PTRACE_MODE_ATTACH_REALCREDS:
// what process_vm_readv asks for) looks at, from /proc/<pid>/status.
struct Credentials {
  std::array<unsigned long, 3> uids{};  // real, effective, saved
  std::array<unsigned long, 3> gids{};
  bool cap_sys_ptrace{false};  // in the effective set
};

std::optional<Credentials> credentials_of(const std::string& who) {
  std::ifstream status{fmt::format("/proc/{}/status", who)};
  Credentials out;
  unsigned found = 0;
  const auto ids = [](const char* p, std::array<unsigned long, 3>& into) {
    for (auto& id : into) {
      char* end = nullptr;
      errno = 0;
      id = std::strtoul(p, &end, 10);
      if (end == p || errno != 0) return false;
      p = end;
    }
    return true;
  };
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("Uid:")) {
      if (!ids(line.c_str() + 4, out.uids)) return std::nullopt;
      found |= 1U;
    } else if (line.starts_with("Gid:")) {
      if (!ids(line.c_str() + 4, out.gids)) return std::nullopt;
      found |= 2U;
    } else if (line.starts_with("CapEff:")) {
      constexpr unsigned CAP_SYS_PTRACE_BIT = 19;
      errno = 0;
      const unsigned long long caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      if (errno != 0) return std::nullopt;
      out.cap_sys_ptrace = ((caps >> CAP_SYS_PTRACE_BIT) & 1U) != 0;
      found |= 4U;
    }
  }
  if (found != 7U) return std::nullopt;
  return out;
}

// Whether a process with `reader`'s credentials may read the memory of one with `target`'s
// (dumpable or not): the same user and group ids throughout, or CAP_SYS_PTRACE; and a
// dumpable target, or CAP_SYS_PTRACE.
bool may_read(const Credentials& reader, const Credentials& target, bool target_dumpable) {
  if (reader.cap_sys_ptrace) return true;
  const auto all = [](const std::array<unsigned long, 3>& ids, unsigned long id) {
    return std::all_of(ids.begin(), ids.end(), [&](unsigned long i) { return i == id; });
  };
  return all(target.uids, reader.uids[0]) && all(target.gids, reader.gids[0]) && target_dumpable;
}

}  // namespace

namespace {

const WorkerAddressInfo::Transport* find_cma(const WorkerAddressInfo& info) {
  const auto it = std::find_if(info.transports.begin(), info.transports.end(),
                               [](const auto& t) { return t.name_checksum == cma_checksum(); });
  return it == info.transports.end() ? nullptr : &*it;
}

}  // namespace

bool cma_on_one_host(const WorkerAddressInfo& peer, const WorkerAddressInfo& own) {
  const auto* const theirs = find_cma(peer);
  const auto* const ours = find_cma(own);
  // The device address is the host's id (and the IPC namespace's): another host's CMA is
  // unreachable for UCX.
  return theirs != nullptr && ours != nullptr &&
         std::equal(theirs->device.begin(), theirs->device.end(), ours->device.begin(),
                    ours->device.end());
}

std::string cma_refusal(const WorkerAddressInfo& peer, const WorkerAddressInfo& own) {
  if (!cma_on_one_host(peer, own)) return {};
  const auto* const theirs = find_cma(peer);
  if (theirs->iface.size() < sizeof(std::uint32_t)) return "the peer's CMA address is too short";
  std::uint32_t id = 0;
  std::memcpy(&id, theirs->iface.data(), sizeof(id));
  const auto pid = static_cast<pid_t>(id & 0x7FFFFFFFU);  // bit 31: a pid namespace follows
  if (pid <= 0) return "the peer's CMA address names no process";
  // This side reading the peer: asked of the kernel (page 0 is never mapped: EFAULT once
  // access is granted, EPERM when not).
  char byte = 0;
  iovec local{&byte, 1};
  iovec remote{nullptr, 1};
  if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) < 0 && errno != EFAULT) {
    return fmt::format("process_vm_readv of process {}: {}", pid, std::strerror(errno));
  }
  // The peer reading this side: the kernel's rule, from what both sides can see; the peer
  // asks the kernel for it and works out this direction by the rule, so both come to the
  // same answer (an endpoint with CMA on one side only fails at its set-up).
  const auto mine = credentials_of("self");
  const auto their = credentials_of(std::to_string(pid));
  if (!mine || !their) {
    return fmt::format("the credentials of process {} cannot be read from /proc", pid);
  }
  if (!may_read(*their, *mine, ::prctl(PR_GET_DUMPABLE) == 1)) {
    return fmt::format(
        "process {} may not read this one (other user or group ids, or this "
        "process is not dumpable, and no CAP_SYS_PTRACE)",
        pid);
  }
  return {};
}

std::vector<std::uint8_t> without_transport(std::span<const std::uint8_t> address,
                                            const WorkerAddressInfo& info,
                                            const WorkerAddressInfo& own,
                                            std::uint16_t name_checksum) {
  // A name no transport of this worker has (nor the one replaced).
  std::uint16_t unknown = ucs_crc16_string("netio3-no-such-transport");
  const auto taken = [&](std::uint16_t checksum) {
    return checksum == name_checksum ||
           std::any_of(own.transports.begin(), own.transports.end(),
                       [&](const auto& t) { return t.name_checksum == checksum; });
  };
  while (taken(unknown)) ++unknown;
  std::vector<std::uint8_t> copy{address.begin(), address.end()};
  for (const auto& transport : info.transports) {
    if (transport.name_checksum != name_checksum) continue;
    if (transport.name_at + 2 > copy.size()) continue;
    detail::store_le16(copy.data() + transport.name_at, unknown);
  }
  return copy;
}

namespace {

// UCX 1.13's tcp transport address (src/uct/tcp/tcp.h, tcp_iface.c): the device part is a
// flags byte and an address family, then the IPv4 or IPv6 address, or for a loopback
// interface a host id and a network namespace (8 bytes each); the transport part is the
// listening port. UCX reads them by the family and the flags, not by their lengths.
std::string check_tcp_address(const WorkerAddressInfo::Transport& tcp) {
  constexpr std::uint8_t FLAG_LOOPBACK = 1U << 0U;
  constexpr std::size_t HEADER = 2;
  constexpr std::size_t LOCAL_ADDRESS = 16;
  if (tcp.device.size() < HEADER) {
    return fmt::format("a tcp transport address with a device part of {} bytes", tcp.device.size());
  }
  const std::uint8_t flags = tcp.device[0];
  const std::uint8_t family = tcp.device[1];
  std::size_t expected = 0;
  if ((flags & ~FLAG_LOOPBACK) != 0) {
    return fmt::format("a tcp transport address with unknown flags {:#x}", flags);
  }
  if (family != AF_INET && family != AF_INET6) {
    return fmt::format("a tcp transport address of address family {}", family);
  }
  if ((flags & FLAG_LOOPBACK) != 0) {
    expected = HEADER + LOCAL_ADDRESS;
  } else {
    expected = HEADER + (family == AF_INET ? sizeof(in_addr) : sizeof(in6_addr));
  }
  if (tcp.device.size() != expected) {
    return fmt::format("a tcp transport address with a device part of {} bytes (expected {})",
                       tcp.device.size(), expected);
  }
  if (tcp.iface.size() != sizeof(std::uint16_t)) {
    return fmt::format("a tcp transport address with a port of {} bytes", tcp.iface.size());
  }
  return {};
}

}  // namespace

std::string check_transport_addresses(const WorkerAddressInfo& peer, const WorkerAddressInfo& own) {
  static const std::uint16_t tcp = ucs_crc16_string("tcp");
  static const std::uint16_t posix = ucs_crc16_string("posix");
  static const std::array<std::uint16_t, 6> same_host{posix,
                                                      ucs_crc16_string("sysv"),
                                                      ucs_crc16_string("cma"),
                                                      ucs_crc16_string("self"),
                                                      ucs_crc16_string("xpmem"),
                                                      ucs_crc16_string("knem")};
  constexpr std::uint64_t POSIX_PROCFS = std::uint64_t{1} << 63U;
  constexpr std::uint64_t POSIX_SHM_OPEN = std::uint64_t{1} << 62U;
  constexpr std::uint64_t POSIX_HUGETLB = std::uint64_t{1} << 61U;
  constexpr std::uint64_t POSIX_PID_NS = std::uint64_t{1} << 60U;
  for (const auto& theirs : peer.transports) {
    // UCX asks each of its transports whether it reaches each of the peer's transport
    // addresses of the same name (ucp_wireup_is_reachable), and only those: an address of a
    // transport this side does not use is never read.
    const auto same_name = [&](const auto& t) { return t.name_checksum == theirs.name_checksum; };
    const auto ours = std::find_if(own.transports.begin(), own.transports.end(), same_name);
    if (ours == own.transports.end()) continue;
    if (theirs.name_checksum == tcp) {
      if (auto bad = check_tcp_address(theirs); !bad.empty()) return bad;
      continue;
    }
    if (std::find(same_host.begin(), same_host.end(), theirs.name_checksum) != same_host.end()) {
      if (theirs.device.size() != ours->device.size() ||
          theirs.iface.size() != ours->iface.size()) {
        return "a same-host transport address of another shape than this side's";
      }
      if (theirs.name_checksum == posix && theirs.iface.size() >= 8 && ours->iface.size() >= 8) {
        const std::uint64_t seg = detail::load_le64(theirs.iface.data());
        const std::uint64_t own_seg = detail::load_le64(ours->iface.data());
        const std::uint64_t mode = POSIX_PROCFS | POSIX_SHM_OPEN | POSIX_HUGETLB | POSIX_PID_NS;
        if ((seg & mode) != (own_seg & mode)) {
          return "a posix shared-memory address of another mode than this side's";
        }
      }
      continue;
    }
    // Any other transport (InfiniBand's, across hosts: their shapes differ by link layer).
    // UCX hands a part of length 0 to the transport as a null pointer, which the transports
    // read without a check (a tcp address without its device part crashed the process in
    // uct_tcp_iface_is_reachable); what an address holds beyond its length is read from the
    // zeros acquire_endpoint puts behind it.
    const bool device_always =
        std::all_of(own.transports.begin(), own.transports.end(),
                    [&](const auto& t) { return !same_name(t) || !t.device.empty(); });
    const bool iface_always =
        std::all_of(own.transports.begin(), own.transports.end(),
                    [&](const auto& t) { return !same_name(t) || !t.iface.empty(); });
    if ((theirs.device.empty() && device_always) || (theirs.iface.empty() && iface_always)) {
      return "a transport address without a part that this side's transport of that name reads";
    }
  }
  return {};
}

}  // namespace netio3::ucx
