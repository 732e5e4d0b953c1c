// Public value types: enum names, EndPointAddress.

#include <algorithm>
#include <array>
#include <cctype>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netio3/types.hpp>
#include <netio3/version.hpp>

namespace netio3 {
namespace {

std::string upper(std::string_view s) {
  std::string out{s};
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string mixed(std::string_view s) {
  std::string out{s};
  for (std::size_t i = 0; i < out.size(); i += 2) {
    out[i] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[i])));
  }
  return out;
}

// Checks names, case-insensitive parsing and fmt output for every value of an enum.
template <typename Enum, std::size_t N, typename Parse>
void check_enum(const std::array<std::pair<Enum, std::string_view>, N>& table, Parse parse) {
  std::set<std::string_view> names;
  for (const auto& [value, name] : table) {
    EXPECT_EQ(to_string(value), name);
    EXPECT_EQ(fmt::format("{}", value), name);
    names.insert(to_string(value));
    for (const std::string& spelling : {std::string{name}, upper(name), mixed(name)}) {
      const auto parsed = parse(spelling);
      ASSERT_TRUE(parsed.has_value()) << spelling;
      EXPECT_EQ(*parsed, value) << spelling;
    }
  }
  EXPECT_EQ(names.size(), N) << "names are unique";
  for (const std::string_view unknown :
       {std::string_view{""}, std::string_view{" "}, std::string_view{"x"},
        std::string_view{"unknown"}, std::string_view{"?"}}) {
    EXPECT_FALSE(parse(unknown).has_value()) << "'" << unknown << "'";
  }
  // Near misses of every name are refused: no prefix matching, no trimming.
  for (const auto& [value, name] : table) {
    EXPECT_FALSE(parse(std::string{name} + " ").has_value()) << name;
    // Appended, not " " + name: GCC 12 at -O3 sees a false overlap in the latter's
    // insert-at-front (-Wrestrict, a false positive).
    std::string leading_space{" "};
    leading_space += name;
    EXPECT_FALSE(parse(leading_space).has_value()) << name;
    EXPECT_FALSE(parse(name.substr(0, name.size() - 1)).has_value()) << name;
    EXPECT_FALSE(parse(std::string{name} + "x").has_value()) << name;
  }
}

TEST(Types, BackendTypeNames) {
  check_enum<BackendType, 3>({{{BackendType::ASYNCMSG, "asyncmsg"},
                               {BackendType::LIBFABRIC, "libfabric"},
                               {BackendType::UCX, "ucx"}}},
                             [](std::string_view s) { return parse_backend_type(s); });
}

TEST(Types, NetworkModeNames) {
  check_enum<NetworkMode, 2>({{{NetworkMode::RDMA, "rdma"}, {NetworkMode::TCP, "tcp"}}},
                             [](std::string_view s) { return parse_network_mode(s); });
}

TEST(Types, ThreadSafetyModelNames) {
  check_enum<ThreadSafetyModel, 2>(
      {{{ThreadSafetyModel::SAFE, "safe"}, {ThreadSafetyModel::UNSAFE, "unsafe"}}},
      [](std::string_view s) { return parse_thread_safety_model(s); });
}

TEST(Types, NetioStatusNames) {
  EXPECT_EQ(to_string(NetioStatus::OK), "ok");
  EXPECT_EQ(to_string(NetioStatus::NO_RESOURCES), "no_resources");
  EXPECT_EQ(to_string(NetioStatus::FAILED), "failed");
  EXPECT_EQ(fmt::format("{}", NetioStatus::NO_RESOURCES), "no_resources");
}

TEST(Types, EnumFormattingHonoursFormatSpecs) {
  EXPECT_EQ(fmt::format("[{:>8}]", BackendType::UCX), "[     ucx]");
  EXPECT_EQ(fmt::format("[{:<5}]", NetworkMode::TCP), "[tcp  ]");
}

TEST(EndPointAddress, BraceConstructionAndEquality) {
  const EndPointAddress a{"127.0.0.1", 5000};
  const EndPointAddress same{"127.0.0.1", 5000};
  const EndPointAddress other_port{"127.0.0.1", 5001};
  const EndPointAddress other_ip{"127.0.0.2", 5000};
  EXPECT_EQ(a, same);
  EXPECT_NE(a, other_port);
  EXPECT_NE(a, other_ip);
  EXPECT_FALSE(a != same);
}

TEST(EndPointAddress, OrderingIsByAddressThenPort) {
  std::vector<EndPointAddress> v{{"10.0.0.2", 1}, {"10.0.0.1", 9}, {"10.0.0.1", 2}, {"::1", 0}};
  std::sort(v.begin(), v.end());
  const std::vector<EndPointAddress> expected{
      {"10.0.0.1", 2}, {"10.0.0.1", 9}, {"10.0.0.2", 1}, {"::1", 0}};
  EXPECT_EQ(v, expected);
  EXPECT_LT((EndPointAddress{"a", 65535}), (EndPointAddress{"b", 0}));
  EXPECT_LT((EndPointAddress{"a", 1}), (EndPointAddress{"a", 2}));
}

TEST(EndPointAddress, HashAgreesWithEqualityAndSeparatesPortsAndAddresses) {
  const std::hash<EndPointAddress> h;
  EXPECT_EQ(h(EndPointAddress{"192.168.0.1", 80}), h(EndPointAddress{"192.168.0.1", 80}));
  std::unordered_set<std::size_t> hashes;
  std::unordered_set<EndPointAddress> set;
  for (std::uint16_t port = 0; port < 1000; ++port) {
    hashes.insert(h(EndPointAddress{"192.168.0.1", port}));
    set.insert(EndPointAddress{"192.168.0.1", port});
    set.insert(EndPointAddress{"192.168.0.1", port});  // duplicate
  }
  EXPECT_EQ(hashes.size(), 1000U) << "ports of one address collide";
  EXPECT_EQ(set.size(), 1000U);
  // The same port on different addresses.
  std::unordered_set<std::size_t> by_address;
  for (int i = 0; i < 256; ++i)
    by_address.insert(h(EndPointAddress{fmt::format("10.0.0.{}", i), 7}));
  EXPECT_GE(by_address.size(), 250U);

  std::unordered_map<EndPointAddress, int> map;
  map[{"::1", 1}] = 1;
  map[{"::1", 2}] = 2;
  EXPECT_EQ(map.at(EndPointAddress{"::1", 1}), 1);
  EXPECT_EQ(map.at(EndPointAddress{"::1", 2}), 2);
}

TEST(EndPointAddress, FormatsIPv4PlainAndIPv6InBrackets) {
  EXPECT_EQ(fmt::format("{}", EndPointAddress{"127.0.0.1", 8080}), "127.0.0.1:8080");
  EXPECT_EQ(fmt::format("{}", EndPointAddress{"::1", 443}), "[::1]:443");
  EXPECT_EQ(fmt::format("{}", EndPointAddress{"fe80::1:2", 0}), "[fe80::1:2]:0");
  EXPECT_EQ(fmt::format("{}", EndPointAddress{"0.0.0.0", 65535}), "0.0.0.0:65535");
  EXPECT_EQ(to_string(EndPointAddress{"::ffff:10.1.2.3", 9}), "[::ffff:10.1.2.3]:9");
  EXPECT_EQ(fmt::format("<{:>16}>", EndPointAddress{"1.2.3.4", 5}), "<       1.2.3.4:5>");
  std::ostringstream os;
  os << EndPointAddress{"::1", 1} << ' ' << EndPointAddress{"1.1.1.1", 2};
  EXPECT_EQ(os.str(), "[::1]:1 1.1.1.1:2");
}

TEST(Version, HeaderAndLibraryCarryTheProjectVersion) {
  EXPECT_STREQ(NETIO3_VERSION_STRING, NETIO3_TEST_PROJECT_VERSION);
  EXPECT_EQ(version_string(), NETIO3_TEST_PROJECT_VERSION);
  const Version v = version();
  EXPECT_EQ(fmt::format("{}.{}.{}", v.major, v.minor, v.patch), NETIO3_TEST_PROJECT_VERSION);
  EXPECT_EQ(NETIO3_VERSION,
            NETIO3_VERSION_MAJOR * 10000 + NETIO3_VERSION_MINOR * 100 + NETIO3_VERSION_PATCH);
}

}  // namespace
}  // namespace netio3
