// Sends one message through the default backend to itself; exit status 0 if it arrived.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include <netio3/netio3.hpp>

int main() {
  using namespace netio3;
  // The library it runs with is the one whose headers it was built against.
  const Version v = version();
  if (v.major != NETIO3_VERSION_MAJOR || v.minor != NETIO3_VERSION_MINOR ||
      v.patch != NETIO3_VERSION_PATCH || version_string() != NETIO3_VERSION_STRING) {
    std::printf("consumer: headers %s, library %.*s\n", NETIO3_VERSION_STRING,
                static_cast<int>(version_string().size()), version_string().data());
    return 1;
  }
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<std::uint8_t> received;
  bool got = false;
  auto loop = std::make_shared<EpollEventLoop>();
  auto backend = Netio3Backend::create(BackendType::ASYNCMSG,
                                       {.mode = NetworkMode::TCP,
                                        .thread_safety = ThreadSafetyModel::SAFE,
                                        .on_data_cb =
                                            [&](std::span<const std::uint8_t> data) {
                                              const std::lock_guard lock{mutex};
                                              received.assign(data.begin(), data.end());
                                              got = true;
                                              cv.notify_all();
                                            }},
                                       loop);
  std::jthread thread{[&] { loop->run(); }};
  const auto listen = backend->open_listen_endpoint({"127.0.0.1", 0}, {});
  // An exception thrown inside the library is caught by its type here: its type_info is
  // exported (NETIO3_API), the internals are not.
  try {
    (void)backend->open_listen_endpoint(listen, {});
    std::printf("consumer: listening twice on %s did not throw\n", to_string(listen).c_str());
    return 1;
  } catch (const ListenEndpointAlreadyExists&) {
  }
  backend->open_active_endpoint(listen, {});
  const std::vector<std::uint8_t> payload{'h', 'i'};
  const std::vector<std::uint8_t> header{'>'};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{10};
  while (backend->send_data_copy(listen, payload, header, 1) == NetioStatus::NO_RESOURCES) {
    if (std::chrono::steady_clock::now() > deadline) return 1;
    std::this_thread::yield();  // still connecting
  }
  std::unique_lock lock{mutex};
  const bool ok = cv.wait_until(lock, deadline, [&] { return got; }) &&
                  received == std::vector<std::uint8_t>{'>', 'h', 'i'};
  std::printf("consumer: %s %s\n", ok ? "received" : "MISSING", fmt::format("{}", listen).c_str());
  lock.unlock();
  backend.reset();
  loop->stop();
  return ok ? 0 : 1;
}
