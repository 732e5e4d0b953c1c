// asyncmsg: frame encoding, FrameDecoder on streams of small and large frames (one chunk,
// awkward splits, and the backend's direct-read path), the send queue, and the send path
// of one message without its system calls.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <sys/uio.h>
#include <vector>

#include <benchmark/benchmark.h>
#include <netio3/types.hpp>

#include "backends/asyncmsg/send_queue.hpp"
#include "backends/asyncmsg/wire.hpp"
#include "bench_util.hpp"
#include "common/endpoint_registry.hpp"
#include "common/notifier.hpp"
#include "common/send_ledger.hpp"
#include "common/thread_model.hpp"

namespace netio3::bench {
namespace {

using asyncmsg::FRAME_HEADER_SIZE;
using asyncmsg::FrameDecoder;
using asyncmsg::SendQueue;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
// The backend's receive scratch buffer and sendmsg limits (asyncmsg_backend.cpp).
constexpr std::size_t SCRATCH_SIZE = MiB;
constexpr std::size_t MAX_IOV = 256;
constexpr std::size_t MAX_WRITE_BYTES = 16 * MiB;

// A stream of `count` frames with `size`-byte messages; message i starts and ends with the
// byte i & 0xff, so a decoder that loses a frame boundary is caught.
std::vector<std::uint8_t> make_stream(std::size_t size, std::size_t count) {
  std::vector<std::uint8_t> stream((FRAME_HEADER_SIZE + size) * count);
  std::uint8_t* p = stream.data();
  for (std::size_t i = 0; i < count; ++i) {
    asyncmsg::encode_frame_header(p, static_cast<std::uint32_t>(size));
    p += FRAME_HEADER_SIZE;
    std::memset(p, static_cast<int>(i & 0xffU), size);
    p += size;
  }
  return stream;
}

// Frames per stream: about 4 MiB of stream, at least 4 frames.
std::size_t frames_for(std::size_t size) {
  return std::max<std::size_t>(4, 4 * MiB / (FRAME_HEADER_SIZE + size));
}

// A decoder past the greeting.
std::unique_ptr<FrameDecoder> greeted_decoder() {
  auto decoder = std::make_unique<FrameDecoder>(DEFAULT_MAX_MESSAGE_SIZE);
  const auto greeting = asyncmsg::encode_greeting(
      asyncmsg::Greeting{.max_message_size = static_cast<std::uint32_t>(DEFAULT_MAX_MESSAGE_SIZE)});
  bool greeted = false;
  const auto status = decoder->feed(
      greeting,
      [&](const asyncmsg::Greeting&) {
        greeted = true;
        return true;
      },
      [](std::span<const std::uint8_t>) { return true; });
  if (status != FrameDecoder::Status::OK || !greeted) return nullptr;
  return decoder;
}

// Checks each decoded message against make_stream's pattern.
struct MessageCheck {
  std::size_t size;
  std::size_t count{0};
  bool bad{false};
  bool operator()(std::span<const std::uint8_t> message) {
    const auto tag = static_cast<std::uint8_t>(count & 0xffU);
    if (message.size() != size || message.front() != tag || message.back() != tag) bad = true;
    ++count;
    return true;
  }
};

// ---- encoding ------------------------------------------------------------------------------

// Frame headers alone, 1024 per iteration into a header array.
void BM_Wire_EncodeHeaders(benchmark::State& state) {
  constexpr std::size_t N = 1024;
  std::vector<std::uint8_t> out(N * FRAME_HEADER_SIZE);
  std::uint32_t length = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < N; ++i) {
      asyncmsg::encode_frame_header(out.data() + i * FRAME_HEADER_SIZE, length++);
    }
    benchmark::ClobberMemory();
    if (asyncmsg::load_le32(out.data() + (N - 1) * FRAME_HEADER_SIZE) != length - 1 ||
        out[4] != asyncmsg::FRAME_DATA) {
      fail(state, "encoded header does not decode");
      break;
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(N));
}
BENCHMARK(BM_Wire_EncodeHeaders);

// Header + payload copy into one contiguous stream (what staging does for copied sends),
// then decoded to check it.
void BM_Wire_EncodeStream(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  const std::size_t count = frames_for(size);
  std::vector<std::uint8_t> payload(size, 0x5a);
  std::vector<std::uint8_t> stream((FRAME_HEADER_SIZE + size) * count);
  for (auto _ : state) {
    std::uint8_t* p = stream.data();
    for (std::size_t i = 0; i < count; ++i) {
      asyncmsg::encode_frame_header(p, static_cast<std::uint32_t>(size));
      std::memcpy(p + FRAME_HEADER_SIZE, payload.data(), size);
      p += FRAME_HEADER_SIZE + size;
    }
    benchmark::ClobberMemory();
  }
  FrameDecoder decoder{DEFAULT_MAX_MESSAGE_SIZE};
  std::size_t messages = 0;
  const auto greeting = asyncmsg::encode_greeting(asyncmsg::Greeting{.max_message_size = 1});
  const auto status = decoder.feed(
      greeting, [](const asyncmsg::Greeting&) { return true; },
      [](std::span<const std::uint8_t>) { return true; });
  const auto status2 = decoder.feed(
      stream, [](const asyncmsg::Greeting&) { return true; },
      [&](std::span<const std::uint8_t> m) {
        if (m.size() == size && (size == 0 || m.back() == 0x5a)) ++messages;
        return true;
      });
  if (status != FrameDecoder::Status::OK || status2 != FrameDecoder::Status::OK ||
      messages != count) {
    fail(state, "encoded stream does not decode");
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(count));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(stream.size()));
}
BENCHMARK(BM_Wire_EncodeStream)->ArgName("msg")->Arg(64)->Arg(64 * KiB)->Arg(MiB);

// ---- decoding ------------------------------------------------------------------------------

// FrameDecoder::feed over a stream of range(0)-byte messages, fed in chunks of range(1)
// bytes (0: the whole stream at once, messages handed out in place). The odd chunk sizes
// cut headers and bodies at arbitrary points; 1 MiB is the backend's scratch buffer.
void BM_Wire_Decode(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  const auto chunk_arg = static_cast<std::size_t>(state.range(1));
  const std::size_t count = frames_for(size);
  const auto stream = make_stream(size, count);
  const std::size_t chunk = chunk_arg == 0 ? stream.size() : chunk_arg;
  auto decoder = greeted_decoder();
  if (!decoder) {
    fail(state, "greeting refused");
    return;
  }
  const auto no_greeting = [](const asyncmsg::Greeting&) { return false; };
  for (auto _ : state) {
    MessageCheck check{size};
    for (std::size_t off = 0; off < stream.size(); off += chunk) {
      const std::span<const std::uint8_t> piece{stream.data() + off,
                                                std::min(chunk, stream.size() - off)};
      if (decoder->feed(piece, no_greeting, check) != FrameDecoder::Status::OK) {
        fail(state, "decoder error: " + decoder->error());
        return;
      }
    }
    if (check.bad || check.count != count || decoder->mid_item()) {
      fail(state, "decoded messages are wrong (" + std::to_string(check.count) + " of " +
                      std::to_string(count) + ")");
      return;
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(count));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(stream.size()));
}
BENCHMARK(BM_Wire_Decode)
    ->ArgNames({"msg", "chunk"})
    ->Args({64, 0})
    ->Args({64, 1000})
    ->Args({64, 65521})
    ->Args({64 * KiB, 0})
    ->Args({64 * KiB, 1000})
    ->Args({64 * KiB, 65521})
    ->Args({64 * KiB, SCRATCH_SIZE})
    ->Args({MiB, 0})
    ->Args({MiB, 65521})
    ->Args({MiB, SCRATCH_SIZE});

// The backend's receive loop without the recv() calls: each "read" of at most range(1)
// bytes goes into the decoder's direct target while a large message is being assembled,
// otherwise into the 1 MiB scratch buffer followed by feed(). Counts the copies the
// receive path really makes for large messages.
void BM_Wire_DecodeReceivePath(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  const auto read_size = static_cast<std::size_t>(state.range(1));
  const std::size_t count = frames_for(size);
  const auto stream = make_stream(size, count);
  auto scratch = std::make_unique_for_overwrite<std::uint8_t[]>(SCRATCH_SIZE);
  auto decoder = greeted_decoder();
  if (!decoder) {
    fail(state, "greeting refused");
    return;
  }
  const auto no_greeting = [](const asyncmsg::Greeting&) { return false; };
  std::uint64_t direct_bytes = 0;
  for (auto _ : state) {
    MessageCheck check{size};
    std::size_t off = 0;
    while (off < stream.size()) {
      std::span<std::uint8_t> target = decoder->direct_target();
      const bool direct = !target.empty();
      if (!direct) target = {scratch.get(), SCRATCH_SIZE};
      const std::size_t n = std::min({target.size(), read_size, stream.size() - off});
      std::memcpy(target.data(), stream.data() + off, n);  // stands for recv()
      off += n;
      const auto status = direct ? decoder->commit_direct(n, check)
                                 : decoder->feed(target.first(n), no_greeting, check);
      if (direct) direct_bytes += n;
      if (status != FrameDecoder::Status::OK) {
        fail(state, "decoder error: " + decoder->error());
        return;
      }
    }
    if (check.bad || check.count != count || decoder->mid_item()) {
      fail(state, "decoded messages are wrong");
      return;
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(count));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(stream.size()));
  state.counters["direct_share"] =
      static_cast<double>(direct_bytes) /
      (static_cast<double>(state.iterations()) * static_cast<double>(stream.size()));
}
BENCHMARK(BM_Wire_DecodeReceivePath)
    ->ArgNames({"msg", "read"})
    ->Args({64, 64 * KiB})
    ->Args({64 * KiB, 64 * KiB})
    ->Args({MiB, 64 * KiB})
    ->Args({MiB, MiB});

// ---- send queue --------------------------------------------------------------------------

// range(2) messages of range(0) bytes are queued (frame header copied; payload copied when
// range(1) = 1, referenced when 0), then flushed as the backend does: gather up to 256
// iovecs / 16 MiB, "write" everything gathered, consume. Chunks come from a ChunkCache as
// in the backend; with one message per flush the queue drains every time and its chunk goes
// back to the cache (a mutex round trip per message).
void BM_SendQueue_Flush(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  const bool copy = state.range(1) != 0;
  const auto batch = static_cast<std::size_t>(state.range(2));
  const std::vector<std::uint8_t> payload(size, 0x42);
  SendQueue queue{std::make_shared<asyncmsg::ChunkCache>(32)};
  std::array<iovec, MAX_IOV> iov{};
  std::vector<detail::SendLedger::Ticket> finished;
  detail::SendLedger::Ticket next_ticket = 0;
  detail::SendLedger::Ticket next_finished = 0;
  std::uint64_t writes = 0;
  std::uint64_t iovecs = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < batch; ++i) {
      std::array<std::uint8_t, FRAME_HEADER_SIZE> header{};
      asyncmsg::encode_frame_header(header.data(), static_cast<std::uint32_t>(size));
      queue.append_copy(header);
      if (copy) {
        queue.append_copy(payload);
      } else {
        queue.append_ref(payload);
      }
      queue.mark(next_ticket++);
    }
    while (!queue.empty()) {
      const std::size_t count = queue.gather(iov.data(), iov.size(), MAX_WRITE_BYTES);
      std::size_t bytes = 0;
      for (std::size_t k = 0; k < count; ++k) bytes += iov[k].iov_len;
      benchmark::DoNotOptimize(iov.data());
      finished.clear();
      queue.consume(bytes, finished);
      ++writes;
      iovecs += count;
      for (const auto ticket : finished) {
        if (ticket != next_finished++) {
          fail(state, "tickets finished out of order");
          return;
        }
      }
    }
  }
  if (next_finished != next_ticket || queue.chunks() != 0) {
    fail(state, "messages not finished or chunks held by an empty queue");
  }
  const auto messages = static_cast<double>(next_ticket);
  state.SetItemsProcessed(static_cast<std::int64_t>(next_ticket));
  state.SetBytesProcessed(static_cast<std::int64_t>(next_ticket * (size + FRAME_HEADER_SIZE)));
  state.counters["writes_per_msg"] = static_cast<double>(writes) / messages;
  state.counters["iov_per_write"] = static_cast<double>(iovecs) / static_cast<double>(writes);
}
BENCHMARK(BM_SendQueue_Flush)
    ->ArgNames({"msg", "copy", "batch"})
    ->Args({64, 1, 1})
    ->Args({64, 1, 64})
    ->Args({64, 0, 1})
    ->Args({64, 0, 64})
    ->Args({64 * KiB, 1, 1})
    ->Args({64 * KiB, 0, 1})
    ->Args({64 * KiB, 0, 64});

// Partial writes: a 64-byte-message backlog drained by "writes" of range(0) bytes, as when
// the socket buffer is full. Per message.
void BM_SendQueue_PartialWrites(benchmark::State& state) {
  const auto write_size = static_cast<std::size_t>(state.range(0));
  constexpr std::size_t SIZE = 64;
  constexpr std::size_t BATCH = 1024;
  const std::vector<std::uint8_t> payload(SIZE, 0x42);
  SendQueue queue{std::make_shared<asyncmsg::ChunkCache>(32)};
  std::array<iovec, MAX_IOV> iov{};
  std::vector<detail::SendLedger::Ticket> finished;
  std::uint64_t tickets = 0;
  std::uint64_t done = 0;
  for (auto _ : state) {
    for (std::size_t i = 0; i < BATCH; ++i) {
      std::array<std::uint8_t, FRAME_HEADER_SIZE> header{};
      asyncmsg::encode_frame_header(header.data(), SIZE);
      queue.append_copy(header);
      queue.append_copy(payload);
      queue.mark(tickets++);
    }
    while (!queue.empty()) {
      const std::size_t count = queue.gather(iov.data(), iov.size(), write_size);
      std::size_t bytes = 0;
      for (std::size_t k = 0; k < count; ++k) bytes += iov[k].iov_len;
      finished.clear();
      queue.consume(bytes, finished);
      done += finished.size();
    }
  }
  if (done != tickets) fail(state, "messages not finished");
  state.SetItemsProcessed(static_cast<std::int64_t>(tickets));
}
BENCHMARK(BM_SendQueue_PartialWrites)->ArgName("write")->Arg(1000)->Arg(16 * KiB);

// ChunkCache take + give (the staging chunk a draining queue returns and the next send
// takes again).
void BM_ChunkCache_TakeGive(benchmark::State& state) {
  asyncmsg::ChunkCache cache{32};
  cache.give(cache.take());
  for (auto _ : state) {
    auto chunk = cache.take();
    if (!chunk) {
      fail(state, "no chunk");
      break;
    }
    benchmark::DoNotOptimize(chunk.get());
    cache.give(std::move(chunk));
  }
  if (cache.cached() != 1) fail(state, "cache lost its chunk");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ChunkCache_TakeGive);

// ---- one message through the send path, without system calls -------------------------------

struct PathConn {
  std::uint64_t id{1};
  EndPointAddress remote;
  std::uint64_t listener_id{0};
  std::atomic<bool> close_requested{false};
  detail::OptionalMutex mutex{true};
  detail::SendLedger ledger;
  SendQueue queue;
  bool flush_pending{false};
  explicit PathConn(std::shared_ptr<asyncmsg::ChunkCache> cache) : queue{std::move(cache)} {}
};
struct PathListener {
  std::uint64_t id{1};
  EndPointAddress address;
};

// A model of asyncmsg's send_data_copy + flush for range(0)-byte messages, range(1) per
// flush, with the same steps and locks as asyncmsg_backend.cpp but the sendmsg() left out
// (as if the kernel took everything): registry lookup, connection lock, frame header and
// payload copy, ledger add, mark; then gather, consume, ledger complete and the
// send-completed callback through the Notifier. The flush-list mutex and the signal that
// wakes the loop are not part of it (see BM_Signal_*).
void BM_AsyncmsgSendPath_NoSyscall(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  const auto batch = static_cast<std::size_t>(state.range(1));
  const std::vector<std::uint8_t> payload(size, 0x17);
  const iovec payload_iov{const_cast<std::uint8_t*>(payload.data()), size};  // NOLINT
  detail::EndpointRegistry<PathConn, PathListener> registry{"asyncmsg", true};
  const EndPointAddress remote{"192.168.100.123", 12345};
  {
    auto conn = std::make_shared<PathConn>(std::make_shared<asyncmsg::ChunkCache>(32));
    conn->remote = remote;
    const auto held = registry.lock();
    registry.add_connection(held, std::move(conn));
  }
  std::uint64_t completed_keys = 0;
  NetworkConfig config;
  config.on_send_completed_cb = [&](const EndPointAddress&, std::uint64_t key) {
    completed_keys += key + 1;
  };
  const detail::Notifier notifier{"asyncmsg", config};
  std::uint64_t key = 0;
  std::uint64_t expected = 0;
  for (auto _ : state) {
    for (std::size_t m = 0; m < batch; ++m) {
      // send_message + enqueue
      const auto conn = registry.get(remote, "send_data_copy");
      const std::span<const iovec> iov{&payload_iov, 1};
      std::size_t total = 0;
      for (const auto& v : iov) total += v.iov_len;
      const std::lock_guard lock{conn->mutex};
      std::array<std::uint8_t, FRAME_HEADER_SIZE> frame{};
      asyncmsg::encode_frame_header(frame.data(), static_cast<std::uint32_t>(total));
      conn->queue.append_copy(frame);
      for (const auto& v : iov) {
        conn->queue.append_copy({static_cast<const std::uint8_t*>(v.iov_base), v.iov_len});
      }
      conn->queue.mark(conn->ledger.add(detail::PendingSend{key, nullptr}));
      conn->flush_pending = true;
      expected += ++key;
    }
    // flush
    const auto conn = registry.get(remote, "flush");
    std::array<iovec, MAX_IOV> iovs{};
    std::vector<detail::SendLedger::Ticket> finished;
    std::vector<detail::PendingSend> completed;
    for (;;) {
      std::size_t count = 0;
      {
        const std::lock_guard lock{conn->mutex};
        count = conn->queue.gather(iovs.data(), iovs.size(), MAX_WRITE_BYTES);
        if (count == 0) conn->flush_pending = false;
      }
      if (count == 0) break;
      std::size_t bytes = 0;
      for (std::size_t k = 0; k < count; ++k) bytes += iovs[k].iov_len;
      benchmark::DoNotOptimize(iovs.data());
      finished.clear();
      completed.clear();
      {
        const std::lock_guard lock{conn->mutex};
        conn->queue.consume(bytes, finished);
        for (const auto ticket : finished) {
          detail::PendingSend done;
          if (conn->ledger.complete(ticket, done)) completed.push_back(done);
        }
      }
      for (const auto& done : completed) notifier.send_completed(conn->remote, done.key);
    }
  }
  if (completed_keys != expected) fail(state, "completions lost");
  state.SetItemsProcessed(static_cast<std::int64_t>(key));
  state.SetBytesProcessed(static_cast<std::int64_t>(key * size));
}
BENCHMARK(BM_AsyncmsgSendPath_NoSyscall)
    ->ArgNames({"msg", "per_flush"})
    ->Args({64, 1})
    ->Args({64, 64})
    ->Args({4 * KiB, 1})
    ->Args({4 * KiB, 64});

}  // namespace
}  // namespace netio3::bench
