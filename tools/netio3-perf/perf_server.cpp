#include "perf_server.hpp"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <sys/resource.h>
#include <utility>

#include <fmt/format.h>

namespace netio3::perf {

std::uint64_t process_cpu_ns() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  const auto ns = [](const timeval& tv) {
    return static_cast<std::uint64_t>(tv.tv_sec) * 1'000'000'000ULL +
           static_cast<std::uint64_t>(tv.tv_usec) * 1000ULL;
  };
  return ns(usage.ru_utime) + ns(usage.ru_stime);
}

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

PerfServer::PerfServer(const ServerOptions& options, std::shared_ptr<BaseEventLoop> loop)
    : m_options{options}, m_loop{std::move(loop)} {
  NetworkConfig config{.mode = options.mode, .thread_safety = ThreadSafetyModel::UNSAFE};
  config.on_data_cb = [this](std::span<const std::uint8_t> data) { on_data(data); };
  config.on_connection_established_cb = [this](const EndPointAddress& remote,
                                               EndpointCapabilities) { on_established(remote); };
  config.on_connection_closed_cb = [this](const EndPointAddress& remote,
                                          const std::vector<std::uint64_t>&) { on_closed(remote); };
  config.on_send_completed_cb = [this](const EndPointAddress& remote, std::uint64_t) {
    on_completed(remote);
  };
  config.limits.max_message_size = std::max(options.max_size, CONTROL_SIZE);
  config.partition_key = options.partition_key;
  m_backend = Netio3Backend::create(options.backend, std::move(config), m_loop);
  m_address = m_backend->open_listen_endpoint({options.bind, options.port}, listen_params());
}

PerfServer::~PerfServer() {
  m_backend.reset();
}

ConnectionParameters PerfServer::listen_params() const {
  const std::size_t size = std::max(m_options.max_size, CONTROL_SIZE);
  return ConnectionParameters{.recv_params = {.buf_size = size, .num_buf = m_options.recv_buffers},
                              .send_buffered_params = {.buf_size = size, .num_buf = 8}};
}

void PerfServer::complain(const std::string& what) {
  // A misbehaving client must not flood the log: the first few complaints, then a count.
  if (++m_complaints <= 10) {
    std::cerr << fmt::format("netio3-perf server: {}\n", what);
  } else if (m_complaints == 11) {
    std::cerr << "netio3-perf server: further complaints are counted, not printed\n";
  }
}

PerfServer::Session* PerfServer::find(std::uint32_t token) {
  if (token == m_cached_token && m_cached != nullptr) return m_cached;
  const auto it = m_sessions.find(token);
  if (it == m_sessions.end()) return nullptr;
  m_cached_token = token;
  m_cached = &it->second;
  return m_cached;
}

void PerfServer::on_established(const EndPointAddress& remote) {
  const std::uint32_t token = m_next_token++;
  auto& session = m_sessions[token];
  session.remote = remote;
  m_token_of[remote] = token;
  if (!m_options.quiet) std::cerr << fmt::format("netio3-perf server: {} connected\n", remote);
  reply(session, encode(Header{.type = Type::HELLO, .token = token}));
}

void PerfServer::on_closed(const EndPointAddress& remote) {
  const auto it = m_token_of.find(remote);
  if (it == m_token_of.end()) return;
  const std::uint32_t token = it->second;
  m_token_of.erase(it);
  auto node = m_sessions.extract(token);
  if (m_cached_token == token) m_cached = nullptr;
  if (!m_options.quiet) std::cerr << fmt::format("netio3-perf server: {} closed\n", remote);
  if (node.empty()) return;
  for (const auto& listener : node.mapped().extra_listeners) {
    try {
      m_backend->close_listen_endpoint(listener);
    } catch (const std::exception& e) {
      complain(fmt::format("closing listener {}: {}", listener, e.what()));
    }
  }
}

void PerfServer::on_completed(const EndPointAddress& remote) {
  // A buffer came back: replies that found none can go now.
  const auto it = m_token_of.find(remote);
  if (it == m_token_of.end()) return;
  Session* s = find(it->second);
  if (s == nullptr || s->unsent.empty()) return;
  std::size_t sent = 0;
  while (sent < s->unsent.size() && try_send(s->remote, s->unsent[sent])) ++sent;
  s->unsent.erase(s->unsent.begin(), s->unsent.begin() + static_cast<std::ptrdiff_t>(sent));
}

bool PerfServer::try_send(const EndPointAddress& to, std::span<const std::uint8_t> message) {
  NetworkBuffer* buffer = m_backend->get_buffer(to);
  if (buffer == nullptr) return false;
  buffer->write(message);
  const auto status = m_backend->send_buffer(to, buffer);
  if (status == NetioStatus::FAILED) complain(fmt::format("a reply to {} failed", to));
  return status != NetioStatus::NO_RESOURCES;
}

void PerfServer::reply(Session& s, std::span<const std::uint8_t> message) {
  if (s.unsent.empty() && try_send(s.remote, message)) return;
  s.unsent.emplace_back(message.begin(), message.end());
}

void PerfServer::on_start(Session& s, std::span<const std::uint8_t> data) {
  const auto start = body<StartBody>(data);
  if (!start || start->size < HEADER_SIZE || start->size > m_options.max_size ||
      (start->test != Test::THROUGHPUT && start->test != Test::LATENCY) ||
      (start->verify != Verify::LIGHT && start->verify != Verify::FULL &&
       start->verify != Verify::SIZE)) {
    complain(fmt::format("{}: bad START (size limit {} B)", s.remote, m_options.max_size));
    ++s.errors;
    return;
  }
  s.started = true;
  s.start = *start;
  s.pattern = std::make_unique<Pattern>(start->size - HEADER_SIZE);
  s.expected_seq = 0;
  s.received = 0;
  s.bytes = 0;
  s.errors = 0;
  s.cpu_at_start = process_cpu_ns();
  s.time_at_start = now_ns();
}

void PerfServer::on_open(Session& s, const Header& h) {
  std::vector<std::uint16_t> ports;
  if (h.seq < MAX_CONNECTIONS) {
    for (std::uint64_t i = 0; i < h.seq; ++i) {
      try {
        const auto address = m_backend->open_listen_endpoint({m_options.bind, 0}, listen_params());
        s.extra_listeners.push_back(address);
        ports.push_back(address.port);
      } catch (const std::exception& e) {
        complain(fmt::format("opening listener {} of {}: {}", i + 1, h.seq, e.what()));
        break;
      }
    }
  } else {
    complain(fmt::format("{}: OPEN of {} listeners refused (limit {})", s.remote, h.seq,
                         MAX_CONNECTIONS - 1));
  }
  std::vector<std::uint8_t> message(HEADER_SIZE + 2 * ports.size());
  encode(Header{.type = Type::PORTS, .token = h.token, .seq = ports.size()}, message);
  std::memcpy(message.data() + HEADER_SIZE, ports.data(), 2 * ports.size());
  reply(s, message);
}

void PerfServer::on_data(std::span<const std::uint8_t> data) {
  const auto h = decode(data);
  Session* s = h ? find(h->token) : nullptr;
  if (s == nullptr) {
    complain(
        fmt::format("a message of {} B that is not netio3-perf's, or of an unknown "
                    "connection",
                    data.size()));
    return;
  }
  switch (h->type) {
    case Type::DATA:
    case Type::PING: {
      const bool ok = s->started && h->seq == s->expected_seq && data.size() == s->start.size &&
                      s->pattern->check(h->seq, data.subspan(HEADER_SIZE), s->start.verify);
      if (!ok) ++s->errors;
      s->expected_seq = h->seq + 1;
      ++s->received;
      s->bytes += data.size();
      if (h->type == Type::PING) {
        // Echo: the same bytes with the type changed. The buffer is written in place, so
        // nothing but the echo itself is copied.
        NetworkBuffer* buffer = s->unsent.empty() ? m_backend->get_buffer(s->remote) : nullptr;
        std::array<std::uint8_t, HEADER_SIZE> header{};
        encode(Header{.type = Type::PONG, .token = h->token, .seq = h->seq}, header);
        if (buffer != nullptr) {
          buffer->write(header);
          buffer->write(data.subspan(HEADER_SIZE));
          const auto status = m_backend->send_buffer(s->remote, buffer);
          if (status != NetioStatus::OK) {
            complain(fmt::format("{}: echo failed: {}", s->remote, status));
          }
          break;
        }
        std::vector<std::uint8_t> pong(data.begin(), data.end());
        std::copy(header.begin(), header.end(), pong.begin());
        s->unsent.push_back(std::move(pong));
      }
      break;
    }
    case Type::START:
      on_start(*s, data);
      break;
    case Type::END: {
      const ReportBody report{.bytes = s->bytes,
                              .errors = s->errors,
                              .cpu_ns = process_cpu_ns() - s->cpu_at_start,
                              .elapsed_ns = now_ns() - s->time_at_start};
      reply(*s,
            message(Header{.type = Type::REPORT, .token = h->token, .seq = s->received}, report));
      s->started = false;
      break;
    }
    case Type::OPEN:
      on_open(*s, *h);
      break;
    default:
      complain(
          fmt::format("{}: unexpected message type {}", s->remote, static_cast<unsigned>(h->type)));
      ++s->errors;
      break;
  }
}

}  // namespace netio3::perf
