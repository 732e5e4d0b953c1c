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

}  // namespace
}  // namespace netio3::detail
