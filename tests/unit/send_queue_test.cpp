// asyncmsg SendQueue: coalescing of copies, referenced segments, partial writes, tickets.

#include "backends/asyncmsg/send_queue.hpp"

#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <sys/uio.h>
#include <vector>

#include <gtest/gtest.h>

#include "test_support.hpp"

namespace netio3::asyncmsg {
namespace {

using Bytes = std::vector<std::uint8_t>;
using Ticket = detail::SendLedger::Ticket;
constexpr std::size_t ALL = std::numeric_limits<std::size_t>::max();
// Far below any staging chunk size.
constexpr std::size_t SMALL_TOTAL = 2000;
// Larger than a staging chunk.
constexpr std::size_t LARGE_COPY = std::size_t{300} << 10U;

struct Gathered {
  std::vector<iovec> iov;
  Bytes bytes;
};

Gathered gather(const SendQueue& q, std::size_t max_iov = 1024, std::size_t max_bytes = ALL) {
  Gathered g;
  g.iov.resize(max_iov);
  g.iov.resize(q.gather(g.iov.data(), max_iov, max_bytes));
  for (const auto& v : g.iov) {
    const auto* p = static_cast<const std::uint8_t*>(v.iov_base);
    g.bytes.insert(g.bytes.end(), p, p + v.iov_len);
  }
  return g;
}

std::size_t total_len(const std::vector<iovec>& iov) {
  std::size_t n = 0;
  for (const auto& v : iov) n += v.iov_len;
  return n;
}

// A queue holding a mix of messages, with the byte stream and message ends it represents.
struct Scenario {
  std::vector<Bytes> payloads;  // referenced memory must outlive the queue
  Bytes stream;
  std::vector<std::uint64_t> ends;  // ends[i]: stream offset after message i (ticket 100 + i)
};

// Message i: an 8-byte "header" copy, then its payload, copied for even i and referenced
// for odd i; sizes vary, including empty payloads.
Scenario make_scenario(SendQueue& q, std::size_t messages) {
  Scenario s;
  s.payloads.reserve(messages);
  for (std::size_t i = 0; i < messages; ++i) {
    const Bytes header = test::pattern(1000 + i, 8);
    s.payloads.push_back(test::pattern(i, (i * 37) % 61));
    const Bytes& payload = s.payloads.back();
    q.append_copy(header);
    if (i % 2 == 0) {
      q.append_copy(payload);
    } else {
      q.append_ref(payload);
    }
    q.mark(100 + i);
    s.stream.insert(s.stream.end(), header.begin(), header.end());
    s.stream.insert(s.stream.end(), payload.begin(), payload.end());
    s.ends.push_back(s.stream.size());
  }
  return s;
}

std::vector<Ticket> tickets_ending_in(const Scenario& s, std::uint64_t from, std::uint64_t to) {
  std::vector<Ticket> out;
  for (std::size_t i = 0; i < s.ends.size(); ++i) {
    if (s.ends[i] > from && s.ends[i] <= to) out.push_back(100 + i);
  }
  return out;
}

TEST(SendQueue, ManySmallCopiesLeaveAsOneIovec) {
  SendQueue q;
  Bytes expected;
  std::size_t i = 0;
  while (expected.size() + 20 <= SMALL_TOTAL) {
    const Bytes piece = test::pattern(i, 1 + i % 19);
    q.append_copy(piece);
    q.mark(i);
    expected.insert(expected.end(), piece.begin(), piece.end());
    ++i;
  }
  ASSERT_GT(i, 100U);
  const Gathered g = gather(q);
  ASSERT_EQ(g.iov.size(), 1U);
  EXPECT_EQ(g.bytes, expected);
  EXPECT_EQ(q.unsent_bytes(), expected.size());
}

TEST(SendQueue, ConsecutiveCopiesIncludingEmptyOnesAreContiguousAndCoalesce) {
  SendQueue q;
  const Bytes a = test::pattern(1, 8);
  const Bytes b = test::pattern(2, 0);
  const Bytes c = test::pattern(3, 100);
  q.append_copy(a);
  q.append_copy(b);
  q.append_copy(c);
  q.append_copy(a);
  const Gathered g = gather(q);
  ASSERT_EQ(g.iov.size(), 1U);
  Bytes expected = a;
  expected.insert(expected.end(), c.begin(), c.end());
  expected.insert(expected.end(), a.begin(), a.end());
  EXPECT_EQ(g.bytes, expected);
}

TEST(SendQueue, ReferencedSegmentsAreSeparateAndNotCopied) {
  SendQueue q;
  const Bytes a = test::pattern(1, 10);
  const Bytes b = test::pattern(2, 20);
  const Bytes c = test::pattern(3, 30);
  q.append_copy(a);
  q.append_ref(b);
  q.append_copy(c);  // lands right after a in staging, but b lies between them
  const Gathered g = gather(q);
  ASSERT_EQ(g.iov.size(), 3U);
  EXPECT_EQ(g.iov[0].iov_len, a.size());
  EXPECT_EQ(g.iov[1].iov_base, static_cast<const void*>(b.data()));
  EXPECT_EQ(g.iov[1].iov_len, b.size());
  EXPECT_EQ(g.iov[2].iov_len, c.size());
  EXPECT_NE(g.iov[0].iov_base, static_cast<const void*>(a.data()));  // a was copied
  Bytes expected = a;
  expected.insert(expected.end(), b.begin(), b.end());
  expected.insert(expected.end(), c.begin(), c.end());
  EXPECT_EQ(g.bytes, expected);
}

TEST(SendQueue, EmptyAppendsAddNothing) {
  SendQueue q;
  q.append_copy({});
  q.append_ref({});
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.unsent_bytes(), 0U);
  EXPECT_TRUE(gather(q).iov.empty());
}

TEST(SendQueue, GatherRespectsItsLimits) {
  SendQueue q;
  const Bytes a = test::pattern(1, 10);
  const Bytes b = test::pattern(2, 20);
  const Bytes c = test::pattern(3, 30);
  q.append_ref(a);
  q.append_ref(b);
  q.append_ref(c);
  Bytes all = a;
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());

  const Gathered two = gather(q, 2);
  EXPECT_EQ(two.iov.size(), 2U);
  EXPECT_EQ(two.bytes, Bytes(all.begin(), all.begin() + 30));
  for (const std::size_t max_bytes : {std::size_t{1}, std::size_t{10}, std::size_t{15},
                                      std::size_t{59}, std::size_t{60}, std::size_t{1000}}) {
    const Gathered g = gather(q, 16, max_bytes);
    const std::size_t want = std::min(max_bytes, all.size());
    EXPECT_EQ(total_len(g.iov), want) << max_bytes;
    EXPECT_EQ(g.bytes, Bytes(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(want)));
  }
  // gather() does not consume.
  EXPECT_EQ(gather(q).bytes, all);
  EXPECT_EQ(q.unsent_bytes(), all.size());
}

TEST(SendQueue, PartialWriteAtEveryBoundaryFinishesTicketsExactlyWhenComplete) {
  constexpr std::size_t MESSAGES = 12;
  SendQueue reference;
  const Scenario ref = make_scenario(reference, MESSAGES);
  const std::size_t total = ref.stream.size();
  ASSERT_EQ(gather(reference).bytes, ref.stream);
  ASSERT_EQ(reference.unsent_bytes(), total);

  for (std::size_t k = 0; k <= total; ++k) {
    SendQueue q;
    const Scenario s = make_scenario(q, MESSAGES);
    std::vector<Ticket> finished;
    q.consume(k, finished);
    ASSERT_EQ(finished, tickets_ending_in(s, 0, k)) << "first write of " << k << " bytes";
    ASSERT_EQ(q.unsent_bytes(), total - k);
    ASSERT_EQ(gather(q).bytes,
              Bytes(s.stream.begin() + static_cast<std::ptrdiff_t>(k), s.stream.end()))
        << "after " << k << " bytes";
    finished.clear();
    q.consume(total - k, finished);
    ASSERT_EQ(finished, tickets_ending_in(s, k, total)) << "second write after " << k;
    EXPECT_TRUE(q.empty());
    EXPECT_EQ(q.unsent_bytes(), 0U);
  }
}

TEST(SendQueue, ByteByByteWritesFinishEachTicketOnItsLastByte) {
  SendQueue q;
  const Scenario s = make_scenario(q, 20);
  std::vector<Ticket> all_finished;
  for (std::size_t k = 1; k <= s.stream.size(); ++k) {
    std::vector<Ticket> finished;
    q.consume(1, finished);
    ASSERT_EQ(finished, tickets_ending_in(s, k - 1, k)) << "byte " << k;
    all_finished.insert(all_finished.end(), finished.begin(), finished.end());
    const Gathered g = gather(q, 1, 1);
    if (k < s.stream.size()) {
      ASSERT_EQ(g.bytes.size(), 1U);
      ASSERT_EQ(g.bytes[0], s.stream[k]);
    } else {
      EXPECT_TRUE(g.iov.empty());
    }
  }
  ASSERT_EQ(all_finished.size(), 20U);
  for (std::size_t i = 0; i < all_finished.size(); ++i) EXPECT_EQ(all_finished[i], 100 + i);
}

TEST(SendQueue, LargeVolumeWithPartialWritesAndAppendsInBetween) {
  // A writer that takes pseudo-random amounts while the producer keeps appending, as a
  // busy connection does; covers staging chunk growth, retirement and reuse.
  std::mt19937 rng{4242};
  SendQueue q;
  Bytes stream;                     // everything appended
  std::vector<std::uint64_t> ends;  // message ends
  std::vector<Bytes> refs;          // referenced payloads, kept alive
  refs.reserve(2000);
  std::size_t written = 0;
  std::vector<Ticket> finished;
  std::uniform_int_distribution<std::size_t> size_dist{0, 3000};
  for (std::size_t i = 0; i < 2000; ++i) {
    const Bytes header = test::pattern(i + 7, 8);
    Bytes payload = test::pattern(i, i % 100 == 0 ? LARGE_COPY + 17 : size_dist(rng));
    q.append_copy(header);
    if (i % 3 == 0) {
      refs.push_back(std::move(payload));
      q.append_ref(refs.back());
      stream.insert(stream.end(), header.begin(), header.end());
      stream.insert(stream.end(), refs.back().begin(), refs.back().end());
    } else {
      q.append_copy(payload);
      stream.insert(stream.end(), header.begin(), header.end());
      stream.insert(stream.end(), payload.begin(), payload.end());
    }
    q.mark(i);
    ends.push_back(stream.size());
    if (i % 4 == 3) {
      // One writev of up to 64 iovecs / 200 KB, of which the kernel takes a part.
      const Gathered g = gather(q, 64, 100'000);
      ASSERT_EQ(g.bytes,
                Bytes(stream.begin() + static_cast<std::ptrdiff_t>(written),
                      stream.begin() + static_cast<std::ptrdiff_t>(written + g.bytes.size())));
      const std::size_t taken = std::uniform_int_distribution<std::size_t>{0, g.bytes.size()}(rng);
      q.consume(taken, finished);
      written += taken;
    }
  }
  while (!q.empty()) {
    const Gathered g = gather(q, 64, 100'000);
    ASSERT_FALSE(g.iov.empty());
    ASSERT_EQ(g.bytes,
              Bytes(stream.begin() + static_cast<std::ptrdiff_t>(written),
                    stream.begin() + static_cast<std::ptrdiff_t>(written + g.bytes.size())));
    const std::size_t taken = std::uniform_int_distribution<std::size_t>{1, g.bytes.size()}(rng);
    q.consume(taken, finished);
    written += taken;
  }
  EXPECT_EQ(written, stream.size());
  EXPECT_EQ(q.unsent_bytes(), 0U);
  ASSERT_EQ(finished.size(), ends.size());
  for (std::size_t i = 0; i < finished.size(); ++i) EXPECT_EQ(finished[i], i);
}

TEST(SendQueue, AppendsAfterTheQueueDrainedAreIntact) {
  SendQueue q;
  std::vector<Ticket> finished;
  for (std::size_t round = 0; round < 5; ++round) {
    const Bytes a = test::pattern(round, 3000);
    const Bytes b = test::pattern(round + 100, 2000);
    q.append_copy(a);
    q.mark(2 * round);
    // Half written: b is appended behind bytes that are still pending.
    q.consume(1500, finished);
    q.append_copy(b);
    q.mark(2 * round + 1);
    Bytes expected(a.begin() + 1500, a.end());
    expected.insert(expected.end(), b.begin(), b.end());
    ASSERT_EQ(gather(q).bytes, expected) << "round " << round;
    q.consume(expected.size(), finished);
    EXPECT_TRUE(q.empty());
  }
  ASSERT_EQ(finished.size(), 10U);
  for (std::size_t i = 0; i < finished.size(); ++i) EXPECT_EQ(finished[i], i);
}

TEST(SendQueue, ClearDropsEverythingAndTheQueueStaysUsable) {
  SendQueue q;
  const Scenario s = make_scenario(q, 10);
  std::vector<Ticket> finished;
  q.consume(5, finished);
  q.clear();
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.unsent_bytes(), 0U);
  EXPECT_TRUE(gather(q).iov.empty());

  const Bytes c = test::pattern(9, 50);
  q.append_copy(c);
  q.mark(777);
  EXPECT_EQ(q.unsent_bytes(), c.size());
  EXPECT_EQ(gather(q).bytes, c);
  finished.clear();
  q.consume(c.size(), finished);
  // Only the new message finishes; the cleared ones never do.
  EXPECT_EQ(finished, (std::vector<Ticket>{777}));
}

}  // namespace
}  // namespace netio3::asyncmsg
