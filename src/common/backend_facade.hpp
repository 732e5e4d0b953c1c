#pragma once

// The public NetworkBackend object of every transport: a thin facade over a shared
// implementation. Loop callbacks hold weak references to the implementation and lock them
// for the duration of a dispatch, so the application may destroy the backend from inside
// one of its callbacks: the facade only asks the implementation to shut down (on the loop
// thread, or inline when the loop is not running) and the memory goes when the dispatch
// unwinds.
//
// Impl provides: start(), shutdown() noexcept, notifier() (its detail::Notifier, through which
// every callback goes), the API calls with iovec payloads
// (send_data / send_data_copy take std::span<const iovec>), and BackendType TYPE.

#include <exception>
#include <memory>
#include <sys/uio.h>

#include <netio3/network_backend.hpp>

#include "common/log.hpp"

namespace netio3::detail {

template <typename Impl>
class BackendFacade final : public NetworkBackend {
 public:
  BackendFacade(NetworkConfig config, std::shared_ptr<BaseEventLoop> loop)
      : m_loop{loop}, m_impl{std::make_shared<Impl>(std::move(config), std::move(loop))} {
    m_impl->start();
  }
  BackendFacade(const BackendFacade&) = delete;
  BackendFacade& operator=(const BackendFacade&) = delete;
  BackendFacade(BackendFacade&&) = delete;
  BackendFacade& operator=(BackendFacade&&) = delete;

  // The implementation, for tests that play a misbehaving peer through it.
  [[nodiscard]] Impl& impl() noexcept { return *m_impl; }

  ~BackendFacade() override {
    // No callback starts from here on, whatever thread destroys and whatever is in flight.
    m_impl->notifier().stop();
    try {
      m_loop->run_sync([impl = m_impl] { impl->shutdown(); });
    } catch (const std::exception& e) {
      NETIO3_ERROR("{}: error while destroying the backend: {}", to_string(Impl::TYPE), e.what());
    }
  }

  EndPointAddress open_listen_endpoint(const EndPointAddress& address,
                                       const ConnectionParameters& params) override {
    return m_impl->open_listen_endpoint(address, params);
  }
  void open_active_endpoint(const EndPointAddress& address,
                            const ConnectionParameters& params) override {
    m_impl->open_active_endpoint(address, params);
  }
  void close_listen_endpoint(const EndPointAddress& address) override {
    m_impl->close_listen_endpoint(address);
  }
  void close_active_endpoint(const EndPointAddress& address) override {
    m_impl->close_active_endpoint(address);
  }
  NetworkBuffer* get_buffer(const EndPointAddress& address) override {
    return m_impl->get_buffer(address);
  }
  NetioStatus send_buffer(const EndPointAddress& address, NetworkBuffer* buffer) override {
    return m_impl->send_buffer(address, buffer);
  }
  NetioStatus send_data(const EndPointAddress& address, std::span<std::uint8_t> data,
                        std::span<const std::uint8_t> header_data, std::uint64_t key) override {
    const iovec iov{data.data(), data.size()};
    return m_impl->send_data(address, std::span{&iov, 1}, header_data, key);
  }
  NetioStatus send_data(const EndPointAddress& address, std::span<const iovec> iov,
                        std::span<const std::uint8_t> header_data, std::uint64_t key) override {
    return m_impl->send_data(address, iov, header_data, key);
  }
  NetioStatus send_data_copy(const EndPointAddress& address, std::span<const std::uint8_t> data,
                             std::span<const std::uint8_t> header_data,
                             std::uint64_t key) override {
    // iovec's base is non-const by POSIX; a copying send only reads it.
    const iovec iov{const_cast<std::uint8_t*>(data.data()), data.size()};  // NOLINT
    return m_impl->send_data_copy(address, std::span{&iov, 1}, header_data, key);
  }
  NetioStatus send_data_copy(const EndPointAddress& address, std::span<const iovec> iov,
                             std::span<const std::uint8_t> header_data,
                             std::uint64_t key) override {
    return m_impl->send_data_copy(address, iov, header_data, key);
  }
  [[nodiscard]] BackendType type() const noexcept override { return Impl::TYPE; }
  [[nodiscard]] ConnectionStatistics statistics(const EndPointAddress& address) const override {
    return m_impl->statistics(address);
  }
  [[nodiscard]] std::vector<ConnectionStatistics> connection_statistics() const override {
    return m_impl->connection_statistics();
  }
  [[nodiscard]] BackendStatistics backend_statistics() const override {
    return m_impl->backend_statistics();
  }

 private:
  std::shared_ptr<BaseEventLoop> m_loop;
  std::shared_ptr<Impl> m_impl;
};

}  // namespace netio3::detail
