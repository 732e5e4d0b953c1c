// SendLedger: every accepted send ends exactly once, by completion or by cancellation.

#include "common/send_ledger.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace netio3::detail {
namespace {

using Ticket = SendLedger::Ticket;

std::vector<std::uint64_t> keys_of(const std::vector<PendingSend>& sends) {
  std::vector<std::uint64_t> keys;
  for (const auto& s : sends) keys.push_back(s.key);
  return keys;
}

TEST(SendLedger, InOrderCompletionReturnsTheAcceptedSends) {
  SendLedger ledger;
  std::array<std::uint8_t, 8> storage{};
  NetworkBuffer buffer{storage, 5};
  std::vector<Ticket> tickets;
  for (std::uint64_t k = 0; k < 5; ++k) {
    tickets.push_back(ledger.add(PendingSend{.key = 10 + k, .buffer = k == 2 ? &buffer : nullptr}));
  }
  EXPECT_EQ(ledger.outstanding(), 5U);
  EXPECT_EQ(std::set<Ticket>(tickets.begin(), tickets.end()).size(), 5U);
  for (std::uint64_t k = 0; k < 5; ++k) {
    PendingSend out{};
    ASSERT_TRUE(ledger.complete(tickets[k], out));
    EXPECT_EQ(out.key, 10 + k);
    EXPECT_EQ(out.buffer, k == 2 ? &buffer : nullptr);
    EXPECT_EQ(ledger.outstanding(), 4 - k);
  }
  EXPECT_FALSE(ledger.closed());
}

TEST(SendLedger, OutOfOrderCompletionInEveryPermutation) {
  std::vector<std::size_t> order{0, 1, 2, 3};
  do {
    SendLedger ledger;
    std::vector<Ticket> tickets;
    for (std::uint64_t k = 0; k < order.size(); ++k) tickets.push_back(ledger.add({.key = k}));
    for (const std::size_t i : order) {
      PendingSend out{};
      ASSERT_TRUE(ledger.complete(tickets[i], out));
      EXPECT_EQ(out.key, i);
    }
    EXPECT_EQ(ledger.outstanding(), 0U);
    // Later sends still get fresh, completable tickets.
    const Ticket next = ledger.add({.key = 99});
    EXPECT_EQ(std::count(tickets.begin(), tickets.end(), next), 0);
    PendingSend out{};
    ASSERT_TRUE(ledger.complete(next, out));
    EXPECT_EQ(out.key, 99U);
  } while (std::next_permutation(order.begin(), order.end()));
}

TEST(SendLedger, ManySendsCompletedInRandomOrderEndExactlyOnce) {
  SendLedger ledger;
  constexpr std::uint64_t N = 2000;
  std::vector<Ticket> tickets;
  for (std::uint64_t k = 0; k < N; ++k) tickets.push_back(ledger.add({.key = k}));
  std::vector<std::size_t> order(N);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937{7});
  std::vector<int> ended(N, 0);
  for (const std::size_t i : order) {
    PendingSend out{};
    ASSERT_TRUE(ledger.complete(tickets[i], out));
    ++ended.at(out.key);
    PendingSend again{};
    EXPECT_FALSE(ledger.complete(tickets[i], again));
  }
  EXPECT_TRUE(std::all_of(ended.begin(), ended.end(), [](int n) { return n == 1; }));
  EXPECT_EQ(ledger.outstanding(), 0U);
}

TEST(SendLedger, DoubleAndUnknownCompletionAreRejectedWithoutChange) {
  SendLedger ledger;
  const Ticket a = ledger.add({.key = 1});
  const Ticket b = ledger.add({.key = 2});
  PendingSend out{};
  ASSERT_TRUE(ledger.complete(b, out));
  PendingSend untouched{.key = 12345};
  EXPECT_FALSE(ledger.complete(b, untouched));
  EXPECT_EQ(untouched.key, 12345U);
  EXPECT_FALSE(ledger.complete(b + 1000, untouched));
  EXPECT_EQ(untouched.key, 12345U);
  EXPECT_EQ(ledger.outstanding(), 1U);
  ASSERT_TRUE(ledger.complete(a, out));
  EXPECT_EQ(out.key, 1U);
  // Both ended: tickets that fell off the front are rejected too.
  EXPECT_FALSE(ledger.complete(a, untouched));
  EXPECT_FALSE(ledger.complete(b, untouched));
}

TEST(SendLedger, CancelAllReturnsTheOpenSendsInAcceptanceOrderAndCloses) {
  SendLedger ledger;
  std::vector<Ticket> tickets;
  for (std::uint64_t k = 0; k < 6; ++k) tickets.push_back(ledger.add({.key = 100 + k}));
  PendingSend out{};
  ASSERT_TRUE(ledger.complete(tickets[3], out));
  ASSERT_TRUE(ledger.complete(tickets[0], out));
  ASSERT_TRUE(ledger.complete(tickets[5], out));

  const auto cancelled = ledger.cancel_all();
  EXPECT_EQ(keys_of(cancelled), (std::vector<std::uint64_t>{101, 102, 104}));
  EXPECT_TRUE(ledger.closed());
  EXPECT_EQ(ledger.outstanding(), 0U);
  // Nothing completes after the close: not the cancelled ones, not the others.
  for (const Ticket t : tickets) EXPECT_FALSE(ledger.complete(t, out));
  // A second cancel has nothing left.
  EXPECT_TRUE(ledger.cancel_all().empty());
}

TEST(SendLedger, CancelAllOnAnEmptyLedgerCloses) {
  SendLedger ledger;
  EXPECT_TRUE(ledger.cancel_all().empty());
  EXPECT_TRUE(ledger.closed());
  PendingSend out{};
  EXPECT_FALSE(ledger.complete(0, out));
}

TEST(SendLedger, RetractUndoesTheLatestAddCompletely) {
  SendLedger ledger;
  const auto a = ledger.add(PendingSend{1, nullptr});
  const auto b = ledger.add(PendingSend{2, nullptr});
  ledger.retract(b);  // the transport refused the send at once
  EXPECT_EQ(ledger.outstanding(), 1U);
  PendingSend out{};
  EXPECT_FALSE(ledger.complete(b, out)) << "a retracted ticket never completes";
  const auto c = ledger.add(PendingSend{3, nullptr});
  EXPECT_TRUE(ledger.complete(a, out));
  EXPECT_EQ(out.key, 1U);
  const auto cancelled = ledger.cancel_all();
  ASSERT_EQ(cancelled.size(), 1U) << "key 2 was never accepted, so it is not cancelled either";
  EXPECT_EQ(cancelled[0].key, 3U);
  (void)c;
}

// Acknowledged: a send ends when both the transport completed it and the peer's count covers
// it, whichever comes last; in every order of the two over four sends.
TEST(SendLedger, AnAcknowledgedSendEndsWhenTransportAndPeerAreBothDone) {
  // Each step: complete ticket t (t < 4), or acknowledge up to t - 4 + 1 (t >= 4).
  std::vector<int> steps{0, 1, 2, 3, 4, 5, 6, 7};
  int orders = 0;
  do {
    // Acknowledgements are cumulative and go forward: only orders with 4..7 ascending.
    std::vector<int> acks;
    for (const int s : steps) {
      if (s >= 4) acks.push_back(s);
    }
    if (!std::is_sorted(acks.begin(), acks.end())) continue;
    ++orders;
    SendLedger ledger;
    ledger.expect_acknowledgements();
    ASSERT_TRUE(ledger.acknowledged());
    std::vector<Ticket> tickets;
    for (std::uint64_t k = 0; k < 4; ++k)
      tickets.push_back(ledger.add(PendingSend{10 + k, nullptr, 100}));
    EXPECT_EQ(ledger.outstanding_bytes(), 400U);
    std::vector<bool> transported(4, false);
    std::uint64_t acked = 0;
    std::vector<std::uint64_t> ended;
    for (const int s : steps) {
      if (s < 4) {
        PendingSend out{};
        const bool ends = ledger.complete(tickets[static_cast<std::size_t>(s)], out);
        transported[static_cast<std::size_t>(s)] = true;
        EXPECT_EQ(ends, static_cast<std::uint64_t>(s) < acked);
        if (ends) ended.push_back(out.key);
      } else {
        acked = static_cast<std::uint64_t>(s - 3);
        std::vector<PendingSend> out;
        ASSERT_TRUE(ledger.acknowledge(acked, out));
        for (const auto& o : out) {
          EXPECT_TRUE(transported[o.key - 10]) << "ended before the transport completed it";
          EXPECT_LT(o.key - 10, acked) << "ended before the peer acknowledged it";
          ended.push_back(o.key);
        }
      }
    }
    EXPECT_EQ(std::set<std::uint64_t>(ended.begin(), ended.end()),
              (std::set<std::uint64_t>{10, 11, 12, 13}));
    EXPECT_EQ(ended.size(), 4U) << "each send ends once";
    EXPECT_EQ(ledger.outstanding(), 0U);
    EXPECT_EQ(ledger.outstanding_bytes(), 0U);
  } while (std::next_permutation(steps.begin(), steps.end()));
  EXPECT_EQ(orders, 40320 / 24);
}

TEST(SendLedger, AcknowledgementsThatGoBackOrPastWhatWasSentAreRejected) {
  SendLedger ledger;
  ledger.expect_acknowledgements();
  const auto a = ledger.add(PendingSend{1, nullptr, 10});
  (void)ledger.add(PendingSend{2, nullptr, 10});
  std::vector<PendingSend> out;
  EXPECT_FALSE(ledger.acknowledge(3, out)) << "3 acknowledged, 2 sent";
  EXPECT_TRUE(ledger.acknowledge(1, out));
  EXPECT_TRUE(out.empty()) << "not completed by the transport yet";
  EXPECT_FALSE(ledger.acknowledge(0, out)) << "an acknowledgement went back";
  EXPECT_TRUE(ledger.acknowledge(1, out)) << "the same count again is harmless";
  PendingSend done{};
  EXPECT_TRUE(ledger.complete(a, done));
  EXPECT_EQ(done.key, 1U);
  const auto cancelled = ledger.cancel_all();
  ASSERT_EQ(cancelled.size(), 1U) << "the unacknowledged send is cancelled";
  EXPECT_EQ(cancelled[0].key, 2U);
  EXPECT_TRUE(ledger.acknowledge(5, out)) << "a closed ledger ignores acknowledgements";
  EXPECT_TRUE(out.empty());
}

TEST(SendLedger, APlainLedgerTakesNoAcknowledgement) {
  SendLedger ledger;
  (void)ledger.add(PendingSend{1, nullptr, 10});
  std::vector<PendingSend> out;
  EXPECT_FALSE(ledger.acknowledged());
  EXPECT_FALSE(ledger.acknowledge(1, out));
  EXPECT_EQ(ledger.outstanding_bytes(), 10U);
}

// Sessions: an acknowledgement may not count what the transport has not completed (its bytes
// would be freed while the socket still needs them), and after a resume the tickets sent again
// count as not transported until the transport completes them once more.
TEST(SendLedger, TransportFirstRejectsAcknowledgementsOfWhatWasNotSentAndAResumeSendsAgain) {
  SendLedger ledger;
  ledger.expect_acknowledgements();
  ledger.expect_transport_first();
  std::vector<Ticket> tickets;
  for (std::uint64_t k = 0; k < 3; ++k) tickets.push_back(ledger.add(PendingSend{k, nullptr, 10}));
  std::vector<PendingSend> out;
  PendingSend done{};
  EXPECT_FALSE(ledger.complete(tickets[0], done)) << "not acknowledged yet";
  EXPECT_FALSE(ledger.acknowledge(2, out)) << "ticket 1 was not written";
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(ledger.acknowledge(1, out));
  ASSERT_EQ(out.size(), 1U);
  EXPECT_EQ(out[0].key, 0U);
  EXPECT_FALSE(ledger.complete(tickets[1], done));
  // A resume from 1: ticket 1 goes on the wire again; until then it cannot be acknowledged.
  ledger.send_again_from(1);
  out.clear();
  EXPECT_FALSE(ledger.acknowledge(2, out));
  EXPECT_FALSE(ledger.complete(tickets[1], done)) << "written again, not acknowledged yet";
  EXPECT_TRUE(ledger.acknowledge(2, out));
  ASSERT_EQ(out.size(), 1U);
  EXPECT_EQ(out[0].key, 1U);
  EXPECT_EQ(ledger.outstanding(), 1U);
}

}  // namespace
}  // namespace netio3::detail
