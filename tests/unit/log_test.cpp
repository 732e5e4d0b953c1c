// Logging: sink replacement, level filtering, level names.

#include "common/log.hpp"

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netio3/log.hpp>

namespace {

// Counts how often it is formatted, to prove that filtered messages are not formatted.
struct Probe {
  std::atomic<int>* formatted;
};

}  // namespace

template <>
struct fmt::formatter<Probe> : fmt::formatter<std::string_view> {
  template <typename FormatContext>
  auto format(const Probe& p, FormatContext& ctx) const {
    ++*p.formatted;
    return fmt::formatter<std::string_view>::format("probe", ctx);
  }
};

namespace netio3 {
namespace {

struct Captured {
  LogLevel level;
  std::string message;
  friend bool operator==(const Captured&, const Captured&) = default;
};

// Installs a capturing sink and restores the defaults afterwards.
class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    m_previous = log_level();
    set_log_sink([this](LogLevel level, std::string_view message) {
      const std::lock_guard lock{m_mutex};
      m_captured.push_back({level, std::string{message}});
    });
  }
  void TearDown() override {
    set_log_sink({});
    set_log_level(m_previous);
  }
  std::vector<Captured> captured() {
    const std::lock_guard lock{m_mutex};
    return m_captured;
  }

 private:
  LogLevel m_previous{LogLevel::info};
  std::mutex m_mutex;
  std::vector<Captured> m_captured;
};

TEST_F(LogTest, SinkReceivesFormattedMessagesWithTheirLevel) {
  set_log_level(LogLevel::trace);
  NETIO3_TRACE("t {}", 1);
  NETIO3_DEBUG("d {}", 2);
  NETIO3_INFO("i {}", 3);
  NETIO3_WARN("w {}", 4);
  NETIO3_ERROR("e {}", 5);
  EXPECT_EQ(captured(), (std::vector<Captured>{{LogLevel::trace, "t 1"},
                                               {LogLevel::debug, "d 2"},
                                               {LogLevel::info, "i 3"},
                                               {LogLevel::warn, "w 4"},
                                               {LogLevel::error, "e 5"}}));
}

TEST_F(LogTest, LevelFiltersLowerLevels) {
  const std::vector<LogLevel> all{LogLevel::trace, LogLevel::debug, LogLevel::info, LogLevel::warn,
                                  LogLevel::error};
  for (const LogLevel threshold : {LogLevel::trace, LogLevel::debug, LogLevel::info, LogLevel::warn,
                                   LogLevel::error, LogLevel::off}) {
    set_log_level(threshold);
    EXPECT_EQ(log_level(), threshold);
    const std::size_t before = captured().size();
    NETIO3_TRACE("x");
    NETIO3_DEBUG("x");
    NETIO3_INFO("x");
    NETIO3_WARN("x");
    NETIO3_ERROR("x");
    const auto got = captured();
    std::vector<LogLevel> levels;
    for (std::size_t i = before; i < got.size(); ++i) levels.push_back(got[i].level);
    std::vector<LogLevel> expected;
    for (const LogLevel l : all) {
      if (static_cast<int>(l) >= static_cast<int>(threshold)) expected.push_back(l);
    }
    EXPECT_EQ(levels, expected) << "threshold " << to_string(threshold);
  }
}

TEST_F(LogTest, FilteredMessagesAreNotFormatted) {
  std::atomic<int> formatted{0};
  set_log_level(LogLevel::info);
  NETIO3_DEBUG("{}", Probe{&formatted});
  NETIO3_TRACE("{}", Probe{&formatted});
  EXPECT_EQ(formatted.load(), 0);
  NETIO3_INFO("{}", Probe{&formatted});
  EXPECT_EQ(formatted.load(), 1);
  EXPECT_EQ(captured().back().message, "probe");
}

TEST_F(LogTest, EmptySinkRestoresTheDefaultAndReplacedSinksAreNotCalled) {
  set_log_level(LogLevel::info);
  int other_calls = 0;
  set_log_sink([&](LogLevel, std::string_view) { ++other_calls; });
  NETIO3_ERROR("to the second sink");
  EXPECT_EQ(other_calls, 1);
  EXPECT_TRUE(captured().empty()) << "the replaced sink was still called";
  set_log_level(LogLevel::off);  // keep the default stderr sink quiet
  set_log_sink({});
  NETIO3_ERROR("to stderr (filtered)");
  EXPECT_EQ(other_calls, 1);
}

TEST_F(LogTest, ThrowingSinkDoesNotPropagate) {
  set_log_level(LogLevel::info);
  set_log_sink([](LogLevel, std::string_view) { throw std::runtime_error{"sink failure"}; });
  EXPECT_NO_THROW(NETIO3_ERROR("dropped"));
}

TEST_F(LogTest, ConcurrentLoggingWhileSinksAreSwapped) {
  set_log_level(LogLevel::info);
  constexpr int THREADS = 4;
  constexpr int PER_THREAD = 500;
  std::atomic<int> a{0};
  std::atomic<int> b{0};
  std::atomic<bool> done{false};
  {
    std::vector<std::jthread> loggers;
    for (int t = 0; t < THREADS; ++t) {
      loggers.emplace_back([] {
        for (int i = 0; i < PER_THREAD; ++i) NETIO3_INFO("message {}", i);
      });
    }
    std::jthread swapper{[&] {
      for (int i = 0; !done.load(); ++i) {
        if (i % 2 == 0) {
          set_log_sink([&](LogLevel, std::string_view) { ++a; });
        } else {
          set_log_sink([&](LogLevel, std::string_view) { ++b; });
        }
      }
    }};
    for (auto& l : loggers) l.join();
    done = true;
  }
  // Every message reached exactly one sink (the capturing one of the fixture, a or b).
  EXPECT_EQ(static_cast<int>(captured().size()) + a.load() + b.load(), THREADS * PER_THREAD);
}

TEST(LogLevelNames, ToStringAndParse) {
  const std::vector<std::pair<LogLevel, std::string_view>> table{
      {LogLevel::trace, "trace"}, {LogLevel::debug, "debug"}, {LogLevel::info, "info"},
      {LogLevel::warn, "warn"},   {LogLevel::error, "error"}, {LogLevel::off, "off"}};
  for (const auto& [level, name] : table) {
    EXPECT_EQ(to_string(level), name);
    EXPECT_EQ(parse_log_level(name), level);
    std::string upper{name};
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    EXPECT_EQ(parse_log_level(upper), level) << upper;
  }
  EXPECT_EQ(parse_log_level("Warning"), LogLevel::warn);
  EXPECT_FALSE(parse_log_level("").has_value());
  EXPECT_FALSE(parse_log_level("verbose").has_value());
  EXPECT_FALSE(parse_log_level("info ").has_value());
  EXPECT_FALSE(parse_log_level("err").has_value());
}

}  // namespace
}  // namespace netio3
