// EndpointRegistry: a connection is found by its address exactly while it is registered, also
// right after it was the last one found (find() tries that one first).

#include "common/endpoint_registry.hpp"

#include <atomic>
#include <cstdint>
#include <memory>

#include <gtest/gtest.h>

namespace netio3::detail {
namespace {

struct TestConn {
  TestConn(std::uint64_t id_, EndPointAddress remote_, std::uint64_t listener = 0)
      : id{id_}, remote{std::move(remote_)}, listener_id{listener} {}
  std::uint64_t id;
  EndPointAddress remote;
  std::uint64_t listener_id;
  std::atomic<bool> close_requested{false};
};

struct TestListener {
  std::uint64_t id;
  EndPointAddress address;
};

using Registry = EndpointRegistry<TestConn, TestListener>;

const EndPointAddress A{"127.0.0.1", 4000};
const EndPointAddress B{"127.0.0.1", 4001};
const EndPointAddress A_OTHER_HOST{"127.0.0.2", 4000};

std::shared_ptr<TestConn> add(Registry& registry, std::uint64_t id, const EndPointAddress& remote,
                              std::uint64_t listener = 0) {
  auto conn = std::make_shared<TestConn>(id, remote, listener);
  const auto held = registry.lock();
  registry.add_connection(held, conn);
  return conn;
}

TEST(EndpointRegistry, FindsEachConnectionByItsWholeAddress) {
  Registry registry{"test", true};
  const auto a = add(registry, 1, A);
  const auto b = add(registry, 2, B);
  // Alternating, so that every lookup follows one of the other address.
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(registry.get(A, "test"), a);
    EXPECT_EQ(registry.get(B, "test"), b);
  }
  // Same port, other host; same host, other port: not the connection found last.
  EXPECT_EQ(registry.get(A, "test"), a);
  EXPECT_THROW((void)registry.get(A_OTHER_HOST, "test"), UnknownActiveEndpoint);
  EXPECT_EQ(registry.get(A, "test"), a);
  EXPECT_THROW((void)registry.get({"127.0.0.1", 4002}, "test"), UnknownActiveEndpoint);
}

TEST(EndpointRegistry, AConnectionTakenForCloseIsNotFoundEvenIfItWasFoundLast) {
  Registry registry{"test", true};
  const auto a = add(registry, 1, A);
  ASSERT_EQ(registry.get(A, "test"), a);
  {
    const auto held = registry.lock();
    EXPECT_EQ(registry.take_for_close(held, A), a);
  }
  EXPECT_THROW((void)registry.get(A, "test"), UnknownActiveEndpoint);
  // Opened again under the same address: the new one.
  const auto again = add(registry, 2, A);
  EXPECT_EQ(registry.get(A, "test"), again);
}

TEST(EndpointRegistry, AReplacedConnectionGivesWayToItsSuccessor) {
  Registry registry{"test", true};
  const auto old = add(registry, 1, A);
  ASSERT_EQ(registry.get(A, "test"), old);
  const auto fresh = std::make_shared<TestConn>(2, A);
  {
    const auto held = registry.lock();
    ASSERT_TRUE(registry.replace_connection(held, old, fresh));
  }
  EXPECT_EQ(registry.get(A, "test"), fresh);
}

TEST(EndpointRegistry, RemovedAndListenerChildConnectionsAreNotFound) {
  Registry registry{"test", true};
  const auto a = add(registry, 1, A);
  ASSERT_EQ(registry.get(A, "test"), a);
  {
    const auto held = registry.lock();
    registry.remove(held, a, false);
  }
  EXPECT_THROW((void)registry.get(A, "test"), UnknownActiveEndpoint);

  const EndPointAddress listen{"127.0.0.1", 5000};
  {
    const auto held = registry.lock();
    registry.add_listener(held, listen, std::make_shared<TestListener>(TestListener{7, listen}));
  }
  const auto child = add(registry, 3, B, 7);
  ASSERT_EQ(registry.get(B, "test"), child);
  {
    const auto held = registry.lock();
    const auto [listener, children] = registry.take_listener(held, listen);
    ASSERT_EQ(children.size(), 1U);
  }
  EXPECT_THROW((void)registry.get(B, "test"), UnknownActiveEndpoint);
}

// An open connection that ended by itself stays findable for sends (its sends are FAILED)
// until its end was reported; one the application closed is gone at once.
TEST(EndpointRegistry, AConnectionThatEndedByItselfIsFoundForSendsUntilReported) {
  Registry registry{"test", true};
  const auto a = add(registry, 1, A);
  {
    const auto held = registry.lock();
    registry.remove(held, a, true);
    EXPECT_EQ(registry.find(held, A), nullptr);  // not for a new connection's checks
  }
  bool ended = false;
  EXPECT_EQ(registry.get(A, "test", &ended), a);
  EXPECT_TRUE(ended);
  // Closing it meanwhile is no error: it is closing already.
  {
    const auto held = registry.lock();
    EXPECT_EQ(registry.take_for_close(held, A), a);
  }
  // A new connection from the same address is found first.
  const auto b = add(registry, 2, A);
  ended = false;
  EXPECT_EQ(registry.get(A, "test", &ended), b);
  EXPECT_FALSE(ended);
  {
    const auto held = registry.lock();
    registry.remove(held, b, false);
    registry.reported(held, a);
  }
  EXPECT_THROW((void)registry.get(A, "test"), UnknownActiveEndpoint);

  const auto c = add(registry, 3, B);
  c->close_requested.store(true);  // the application closed it
  {
    const auto held = registry.lock();
    registry.remove(held, c, true);
  }
  EXPECT_THROW((void)registry.get(B, "test"), UnknownActiveEndpoint);
}

TEST(EndpointRegistry, NothingIsFoundAfterTakeAll) {
  Registry registry{"test", true};
  const auto a = add(registry, 1, A);
  ASSERT_EQ(registry.get(A, "test"), a);
  {
    const auto held = registry.lock();
    const auto all = registry.take_all(held);
    EXPECT_EQ(all.connections.size(), 1U);
  }
  EXPECT_THROW((void)registry.get(A, "test"), UnknownActiveEndpoint);
  // The registry holds no reference to it any more.
  EXPECT_EQ(a.use_count(), 1);
}

// A resumed session's messages carry a new token: an alias finds the same connection while
// its own id stays indexed; an alias never takes an id in use, and goes with forget_alias.
TEST(EndpointRegistry, AnAliasFindsItsConnectionUntilForgotten) {
  Registry registry{"test", true};
  const auto a = add(registry, 1, A);
  const auto b = add(registry, 2, B);
  registry.index(a);
  registry.index(b);
  EXPECT_EQ(registry.by_id(7), nullptr);
  ASSERT_TRUE(registry.alias(7, a));
  EXPECT_EQ(registry.by_id(7), a);
  EXPECT_EQ(registry.by_id(1), a);
  EXPECT_FALSE(registry.alias(2, a)) << "an indexed id is not an alias";
  EXPECT_EQ(registry.by_id(2), b);
  EXPECT_FALSE(registry.alias(7, b)) << "an alias in use is not taken again";
  EXPECT_EQ(registry.by_id(7), a);
  {
    const auto held = registry.lock();
    EXPECT_TRUE(registry.id_in_use(held, 7));
  }
  EXPECT_EQ(registry.indexed().size(), 2U) << "an alias is no second connection";
  registry.forget_alias(7);
  EXPECT_EQ(registry.by_id(7), nullptr);
  EXPECT_EQ(registry.by_id(1), a);
  {
    const auto held = registry.lock();
    EXPECT_FALSE(registry.id_in_use(held, 7));
  }
  ASSERT_TRUE(registry.alias(8, b));
  registry.clear_index();
  EXPECT_EQ(registry.by_id(8), nullptr);
}

}  // namespace
}  // namespace netio3::detail
