// Shared machinery of the backends (src/common): buffer pool, send ledger, notifier and the
// endpoint registry lookup every send does.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <netio3/network_buffer.hpp>
#include <netio3/types.hpp>

#include "bench_util.hpp"
#include "common/buffer_pool.hpp"
#include "common/endpoint_registry.hpp"
#include "common/notifier.hpp"
#include "common/send_ledger.hpp"

namespace netio3::bench {
namespace {

using detail::BufferPool;
using detail::PendingSend;
using detail::SendLedger;

constexpr std::size_t POOL_BUFFERS = 64;
constexpr std::size_t POOL_BUF_SIZE = 4096;
constexpr std::size_t HEADROOM = 8;

// ---- buffer pool ------------------------------------------------------------------------

// acquire + release; range(0): 1 = thread-safe pool (mutex), 0 = ThreadSafetyModel::UNSAFE.
void BM_Pool_AcquireRelease(benchmark::State& state) {
  BufferPool pool{POOL_BUFFERS, POOL_BUF_SIZE, HEADROOM, state.range(0) != 0};
  for (auto _ : state) {
    NetworkBuffer* buffer = pool.acquire();
    if (buffer == nullptr || buffer->size() != 0) {
      fail(state, "acquire returned no (or a non-empty) buffer");
      break;
    }
    benchmark::DoNotOptimize(buffer);
    pool.release(buffer);
  }
  if (pool.free_count() != POOL_BUFFERS) fail(state, "buffers lost");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Pool_AcquireRelease)->ArgName("thread_safe")->Arg(0)->Arg(1);

// The whole life of a buffered send as the pool sees it: acquire, write 64 bytes,
// begin_send, and release on completion (thread-safe pool).
void BM_Pool_BufferedSendCycle(benchmark::State& state) {
  BufferPool pool{POOL_BUFFERS, POOL_BUF_SIZE, HEADROOM, true};
  std::array<std::uint8_t, 64> payload{};
  std::iota(payload.begin(), payload.end(), std::uint8_t{1});
  for (auto _ : state) {
    NetworkBuffer* buffer = pool.acquire();
    if (buffer == nullptr) {
      fail(state, "pool empty");
      break;
    }
    buffer->write(payload);
    if (!pool.begin_send(buffer) || buffer->size() != payload.size()) {
      fail(state, "begin_send refused a lent buffer");
      break;
    }
    benchmark::DoNotOptimize(buffer->data());
    pool.release(buffer);
  }
  if (pool.free_count() != POOL_BUFFERS) fail(state, "buffers lost");
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(payload.size()));
}
BENCHMARK(BM_Pool_BufferedSendCycle);

// acquire + release on a thread-safe pool while a second thread does the same (e.g. an
// application thread getting buffers while the loop thread returns completed ones). The
// time is the benchmark thread's; other_thread_ops counts the second thread's pairs.
void BM_Pool_Contended(benchmark::State& state) {
  BufferPool pool{POOL_BUFFERS, POOL_BUF_SIZE, HEADROOM, true};
  std::atomic<bool> stop{false};
  std::atomic<bool> other_failed{false};
  std::uint64_t other_ops = 0;
  std::thread other{[&] {
    while (!stop.load(std::memory_order_relaxed)) {
      NetworkBuffer* buffer = pool.acquire();
      if (buffer == nullptr) {
        other_failed.store(true);
        return;
      }
      buffer->write(std::uint32_t{42});
      pool.release(buffer);
      ++other_ops;
    }
  }};
  for (auto _ : state) {
    NetworkBuffer* buffer = pool.acquire();
    if (buffer == nullptr) {
      fail(state, "pool empty although at most 2 buffers are lent");
      break;
    }
    buffer->write(std::uint32_t{7});
    benchmark::DoNotOptimize(buffer->data());
    pool.release(buffer);
  }
  stop.store(true);
  other.join();
  if (other_failed.load()) fail(state, "second thread found the pool empty");
  if (pool.free_count() != POOL_BUFFERS) fail(state, "buffers lost");
  state.SetItemsProcessed(state.iterations());
  state.counters["other_thread_ops"] = static_cast<double>(other_ops);
}
BENCHMARK(BM_Pool_Contended)->UseRealTime();

// ---- send ledger ------------------------------------------------------------------------

// Steady state with range(0) sends outstanding: each item adds one send and completes the
// oldest (a stream whose completions come in order).
void BM_Ledger_SteadyInOrder(benchmark::State& state) {
  const auto window = static_cast<std::uint64_t>(state.range(0));
  SendLedger ledger;
  std::uint64_t next_key = 0;
  std::uint64_t next_done = 0;
  for (std::uint64_t i = 0; i < window; ++i) (void)ledger.add(PendingSend{next_key++, nullptr});
  for (auto _ : state) {
    (void)ledger.add(PendingSend{next_key++, nullptr});
    PendingSend out;
    if (!ledger.complete(next_done, out) || out.key != next_done) {
      fail(state, "completion refused or wrong key");
      break;
    }
    ++next_done;
  }
  if (ledger.outstanding() != window) fail(state, "outstanding count drifted");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Ledger_SteadyInOrder)->ArgName("window")->Arg(1)->Arg(64)->Arg(4096);

// Batches: add range(0) sends, then complete all of them in order (0), in reverse (1) or
// shuffled (2). Out of order, the ledger keeps done entries until the oldest completes.
void BM_Ledger_Batch(benchmark::State& state) {
  const auto batch = static_cast<std::size_t>(state.range(0));
  const auto order = state.range(1);
  std::vector<std::size_t> perm(batch);
  std::iota(perm.begin(), perm.end(), std::size_t{0});
  if (order == 1) std::reverse(perm.begin(), perm.end());
  if (order == 2) std::shuffle(perm.begin(), perm.end(), std::mt19937_64{12345});
  SendLedger ledger;
  std::vector<SendLedger::Ticket> tickets(batch);
  std::uint64_t key = 0;
  std::uint64_t key_sum = 0;
  std::uint64_t expected_sum = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < batch; ++i) {
      expected_sum += key;
      tickets[i] = ledger.add(PendingSend{key++, nullptr});
    }
    for (const std::size_t i : perm) {
      PendingSend out;
      if (!ledger.complete(tickets[i], out)) {
        fail(state, "completion refused");
        return;
      }
      key_sum += out.key;
    }
    if (ledger.outstanding() != 0) {
      fail(state, "sends left outstanding");
      return;
    }
  }
  if (key_sum != expected_sum) fail(state, "completed keys do not match the added ones");
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(batch));
  static constexpr std::array<const char*, 3> ORDER{"in order", "reverse", "shuffled"};
  state.SetLabel(ORDER.at(static_cast<std::size_t>(order)));
}
BENCHMARK(BM_Ledger_Batch)->ArgNames({"batch", "order"})->ArgsProduct({{64, 4096}, {0, 1, 2}});

// cancel_all_sends with range(0) sends outstanding (connection close): keys back in order,
// and with range(1) = 1 each one a buffered send whose buffer goes back to the pool. Only
// the cancel is timed (manual time); filling the ledger is not.
void BM_Ledger_CancelAll(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const bool buffered = state.range(1) != 0;
  BufferPool pool{buffered ? n : 1, 64, HEADROOM, true};
  for (auto _ : state) {
    SendLedger ledger;
    for (std::size_t i = 0; i < n; ++i) {
      NetworkBuffer* buffer = nullptr;
      if (buffered) {
        buffer = pool.acquire();
        if (buffer == nullptr || !pool.begin_send(buffer)) {
          fail(state, "pool refused a buffer");
          return;
        }
      }
      (void)ledger.add(PendingSend{i, buffer});
    }
    // Complete every 4th send first, as a connection with traffic would have.
    for (std::size_t i = 0; i < n; i += 4) {
      PendingSend out;
      if (!ledger.complete(i, out)) {
        fail(state, "completion refused");
        return;
      }
      if (out.buffer != nullptr) pool.release(out.buffer);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const auto keys = detail::cancel_all_sends(ledger, buffered ? &pool : nullptr);
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    if (keys.size() != n - (n + 3) / 4 || !std::is_sorted(keys.begin(), keys.end()) ||
        !ledger.closed() || (buffered && pool.free_count() != n)) {
      fail(state, "cancel_all_sends: wrong keys, order or buffers");
      return;
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
}
BENCHMARK(BM_Ledger_CancelAll)
    ->ArgNames({"outstanding", "buffered"})
    ->ArgsProduct({{16, 1024, 65536}, {0, 1}})
    ->UseManualTime();

// ---- notifier ----------------------------------------------------------------------------

// One send-completion callback through the Notifier (level check, std::function call,
// exception guard). range(0) = 0: no callback installed.
void BM_Notifier_SendCompleted(benchmark::State& state) {
  std::uint64_t sum = 0;
  NetworkConfig config;
  if (state.range(0) != 0) {
    config.on_send_completed_cb = [&sum](const EndPointAddress&, std::uint64_t key) { sum += key; };
  }
  const detail::Notifier notifier{"bench", config};
  const EndPointAddress remote{"192.168.100.123", 12345};
  std::uint64_t key = 0;
  std::uint64_t expected = 0;
  for (auto _ : state) {
    notifier.send_completed(remote, key);
    expected += key;
    ++key;
  }
  if (state.range(0) != 0 && sum != expected) fail(state, "callback missed keys");
  benchmark::DoNotOptimize(sum);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Notifier_SendCompleted)->ArgName("callback")->Arg(0)->Arg(1);

// One data callback through the Notifier (64-byte message).
void BM_Notifier_Data(benchmark::State& state) {
  std::uint64_t bytes = 0;
  NetworkConfig config;
  config.on_data_cb = [&bytes](std::span<const std::uint8_t> data) { bytes += data.size(); };
  const detail::Notifier notifier{"bench", config};
  const EndPointAddress remote{"192.168.100.123", 12345};
  const std::array<std::uint8_t, 64> message{};
  for (auto _ : state) notifier.data(remote, message);
  if (bytes != static_cast<std::uint64_t>(state.iterations()) * message.size()) {
    fail(state, "data callback missed messages");
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Notifier_Data);

// ---- endpoint registry ---------------------------------------------------------------------

struct RegConn {
  std::uint64_t id{1};
  EndPointAddress remote;
  std::uint64_t listener_id{0};
  std::atomic<bool> close_requested{false};
};
struct RegListener {
  std::uint64_t id{1};
  EndPointAddress address;
};

// EndpointRegistry::get, done by every send*() call: lock, hash the address string, look
// it up, copy a shared_ptr. range(0) connections registered; lookups cycle through them.
void BM_Registry_Get(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  detail::EndpointRegistry<RegConn, RegListener> registry{"bench", true};
  std::vector<EndPointAddress> addresses;
  for (std::size_t i = 0; i < n; ++i) {
    auto conn = std::make_shared<RegConn>();
    conn->remote = EndPointAddress{"192.168.100." + std::to_string(100 + i % 100),
                                   static_cast<std::uint16_t>(20000 + i)};
    addresses.push_back(conn->remote);
    const auto held = registry.lock();
    registry.add_connection(held, std::move(conn));
  }
  std::size_t i = 0;
  for (auto _ : state) {
    const auto& address = addresses[i];
    const auto conn = registry.get(address, "send_data");
    if (conn == nullptr || conn->remote.port != address.port) {
      fail(state, "lookup returned the wrong connection");
      break;
    }
    benchmark::DoNotOptimize(conn.get());
    if (++i == n) i = 0;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Registry_Get)->ArgName("connections")->Arg(1)->Arg(256);

}  // namespace
}  // namespace netio3::bench
