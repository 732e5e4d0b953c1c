// LazyDeque: a deque that allocates only when its first element arrives.

#include "common/lazy_deque.hpp"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace netio3::detail {
namespace {

TEST(LazyDeque, AnUnusedQueueIsAnEmptyRangeAndAllocatesNothing) {
  LazyDeque<std::string> q;
  const auto& cq = q;
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.size(), 0U);
  EXPECT_EQ(q.begin(), q.end());
  EXPECT_EQ(cq.begin(), cq.end());
  int visited = 0;
  for (const auto& s : q) visited += static_cast<int>(s.size()) + 1;
  EXPECT_EQ(visited, 0);
  q.clear();
  EXPECT_FALSE(q.allocated());
}

TEST(LazyDeque, BehavesAsADequeOnceUsed) {
  LazyDeque<int> q;
  for (int i = 0; i < 1000; ++i) q.push_back(i);
  EXPECT_TRUE(q.allocated());
  ASSERT_EQ(q.size(), 1000U);
  EXPECT_EQ(q.front(), 0);
  EXPECT_EQ(q.back(), 999);
  EXPECT_EQ(q[500], 500);
  const int* stable = &q[500];
  for (int i = 0; i < 10; ++i) q.pop_front();
  q.pop_back();
  EXPECT_EQ(q.front(), 10);
  EXPECT_EQ(q.back(), 998);
  EXPECT_EQ(stable, &q[490]);  // elements stay where they are, as in a deque
  std::vector<int> seen(q.begin(), q.end());
  ASSERT_EQ(seen.size(), 989U);
  EXPECT_EQ(seen.front(), 10);
  EXPECT_EQ(seen.back(), 998);
  q.clear();
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(q.begin(), q.end());
  EXPECT_EQ(q.emplace_back(7), 7);
  EXPECT_EQ(q.size(), 1U);
}

}  // namespace
}  // namespace netio3::detail
