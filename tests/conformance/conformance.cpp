#include "conformance.hpp"

#include <algorithm>
#include <cstring>
#include <shared_mutex>

namespace netio3::conformance {

std::string_view to_string(SendMode mode) {
  switch (mode) {
    case SendMode::BUFFERED:
      return "buffered";
    case SendMode::ZERO_COPY:
      return "zerocopy";
    case SendMode::COPY:
      return "copy";
  }
  return "?";
}

const BackendTraits& traits(BackendType type) {
  static const BackendTraits ASYNCMSG{.type = BackendType::ASYNCMSG,
                                      .mode = NetworkMode::TCP,
                                      .copy_supported = true,
                                      .zero_copy_needs_region = false,
                                      .buffered_zero_copy_exclusive = false,
                                      .honours_unsafe = false,
                                      .receive_needs_buffers = false};
  static const BackendTraits LIBFABRIC{.type = BackendType::LIBFABRIC,
                                       .mode = NetworkMode::TCP,
                                       .copy_supported = false,
                                       .zero_copy_needs_region = true,
                                       .buffered_zero_copy_exclusive = true,
                                       .honours_unsafe = true,
                                       .receive_needs_buffers = true};
  static const BackendTraits UCX{.type = BackendType::UCX,
                                 .mode = test::mode_for(BackendType::UCX),
                                 .copy_supported = true,
                                 .zero_copy_needs_region = true,
                                 .buffered_zero_copy_exclusive = false,
                                 .honours_unsafe = true,
                                 .receive_needs_buffers = false};
  switch (type) {
    case BackendType::ASYNCMSG:
      return ASYNCMSG;
    case BackendType::LIBFABRIC:
      return LIBFABRIC;
    case BackendType::UCX:
      return UCX;
  }
  return ASYNCMSG;
}

std::vector<BackendType> backends() {
  return Netio3Backend::available();
}

Node::Node(BackendType type_, ThreadSafetyModel model_,
           const std::function<void(NetworkConfig&)>& tweak, Recorder::Callbacks callbacks)
    : type{type_}, model{model_}, traits{conformance::traits(type_)} {
  auto config = rec.config(model, traits.mode, callbacks);
  if (tweak) tweak(config);
  backend = Netio3Backend::create(type, std::move(config), loop.loop());
}

Node::~Node() {
  // Hooks run on the loop thread; removing the hook there guarantees none is running when
  // the backend goes away.
  loop.loop()->run_sync([this] { rec.set_hook(nullptr); });
  destroy_backend();
}

void Node::destroy_backend() {
  backend.reset();
}

std::vector<ModeParam> mode_params() {
  std::vector<ModeParam> out;
  for (const auto backend : backends()) {
    for (const auto mode : {SendMode::BUFFERED, SendMode::ZERO_COPY, SendMode::COPY}) {
      for (const auto model : {ThreadSafetyModel::SAFE, ThreadSafetyModel::UNSAFE}) {
        out.push_back({backend, mode, model});
      }
    }
  }
  return out;
}

std::vector<ModeParam> mode_params_with_sessions() {
  auto out = mode_params();
  const auto plain = out.size();
  for (std::size_t i = 0; i < plain; ++i) {
    if (out[i].backend != BackendType::ASYNCMSG) continue;
    auto with_session = out[i];
    with_session.session = true;
    out.push_back(with_session);
  }
  return out;
}

std::string mode_param_name(const testing::TestParamInfo<ModeParam>& info) {
  const auto& p = info.param;
  return fmt::format("{}_{}_{}{}", netio3::to_string(p.backend), to_string(p.mode),
                     netio3::to_string(p.model), p.session ? "_session" : "");
}

ConnectionParameters sender_params(const BackendTraits& traits, SendMode mode,
                                   std::span<std::uint8_t> region, std::size_t buf_size,
                                   std::size_t recv_size) {
  ConnectionParameters params{};
  params.recv_params = {.buf_size = recv_size, .num_buf = NUM_BUF};
  switch (mode) {
    case SendMode::BUFFERED:
      params.send_buffered_params = {.buf_size = buf_size, .num_buf = NUM_BUF};
      break;
    case SendMode::ZERO_COPY:
      params.send_zero_copy_params = {.buf_size = region.size(), .mr_start = region.data()};
      break;
    case SendMode::COPY:
      break;
  }
  (void)traits;
  return params;
}

ConnectionParameters receiver_params(std::size_t max_message) {
  const std::size_t size = std::max(max_message, BUF_SIZE);
  return ConnectionParameters{.recv_params = {.buf_size = size, .num_buf = 4 * NUM_BUF},
                              .send_buffered_params = {.buf_size = size, .num_buf = NUM_BUF}};
}

std::optional<EndPointAddress> wait_connected(Node& client, Node& server,
                                              const EndPointAddress& listen) {
  const bool ok_client =
      client.rec.wait([&](const Recorder& r) { return r.count(Kind::ESTABLISHED, listen) == 1; });
  const bool ok_server =
      server.rec.wait([](const Recorder& r) { return r.count(Kind::ESTABLISHED) >= 1; });
  if (!ok_client || !ok_server) return std::nullopt;
  for (const auto& e : server.rec.snapshot()) {
    if (e.kind == Kind::ESTABLISHED) return e.remote;
  }
  return std::nullopt;
}

NetioStatus try_send(Node& node, const EndPointAddress& to, SendMode mode,
                     std::span<const std::uint8_t> message, std::span<std::uint8_t> region,
                     std::uint64_t index, std::uint64_t* key_out) {
  const std::size_t header_len = std::min<std::size_t>(message.size(), 8);
  const auto header = message.first(header_len);
  const auto payload = message.subspan(header_len);
  NetioStatus status = NetioStatus::FAILED;
  std::uint64_t key = index;
  switch (mode) {
    case SendMode::BUFFERED: {
      // SAFE: the connection must not close between get_buffer and send_buffer (see
      // Recorder::hold_buffers). UNSAFE runs on the loop thread, which is serial anyway.
      std::shared_lock<std::shared_mutex> guard;
      if (node.model == ThreadSafetyModel::SAFE) guard = node.rec.hold_buffers();
      status = node.call([&] {
        NetworkBuffer* buffer = node.backend->get_buffer(to);
        if (buffer == nullptr) return NetioStatus::NO_RESOURCES;
        buffer->write(message);
        key = buffer->id();
        const auto s = node.backend->send_buffer(to, buffer);
        return s;
      });
      break;
    }
    case SendMode::ZERO_COPY: {
      // The payload must already be at region[offset]; find it by content position.
      auto* where = region.data() + index * message.size() + header_len;
      if (!payload.empty()) std::memcpy(where, payload.data(), payload.size());
      status = node.call([&] {
        return node.backend->send_data(to, std::span<std::uint8_t>{where, payload.size()}, header,
                                       index);
      });
      break;
    }
    case SendMode::COPY:
      status = node.call([&] { return node.backend->send_data_copy(to, payload, header, index); });
      break;
  }
  if (key_out != nullptr) *key_out = key;
  return status;
}

// Whether the last of the connection events recorded for `remote` is its close: a backend
// still knows a connection while its closed callback runs (the recorder has it already), and
// get_buffer() has no buffer for it then, which is no back-pressure. A new connection to the
// same address records its ESTABLISHED or REFUSED later.
bool closed_last(const Recorder& rec, const EndPointAddress& remote) {
  const auto events = rec.snapshot();
  for (auto it = events.rbegin(); it != events.rend(); ++it) {
    if (it->remote != remote) continue;
    if (it->kind == Kind::CLOSED) return true;
    if (it->kind == Kind::ESTABLISHED || it->kind == Kind::REFUSED) return false;
  }
  return false;
}

NetioStatus send_one(Node& node, const EndPointAddress& to, SendMode mode,
                     std::span<const std::uint8_t> message, std::span<std::uint8_t> region,
                     std::uint64_t index, std::uint64_t* key_out) {
  const auto deadline = std::chrono::steady_clock::now() + test::DEFAULT_TIMEOUT;
  for (;;) {
    const std::size_t completed_before =
        node.rec.snapshot().size();  // any new event may have freed resources
    const NetioStatus status = try_send(node, to, mode, message, region, index, key_out);
    if (status != NetioStatus::NO_RESOURCES) return status;
    // Back-pressure: wait for something to happen (a completion frees a buffer or queue
    // space) before retrying. Right after a close was recorded, try again shortly: its
    // callback returns without a further event, and the connection is gone then.
    const bool just_closed = closed_last(node.rec, to);
    const auto pause = just_closed ? std::chrono::milliseconds{1} : test::DEFAULT_TIMEOUT;
    if (!node.rec.wait([&](const Recorder& r) { return r.events().size() > completed_before; },
                       pause) &&
        (!just_closed || std::chrono::steady_clock::now() > deadline)) {
      ADD_FAILURE() << "NO_RESOURCES persisted for " << test::DEFAULT_TIMEOUT.count()
                    << " ms with no event that could free resources";
      return status;
    }
  }
}

}  // namespace netio3::conformance
