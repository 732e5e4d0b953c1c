#pragma once

// The observability tests' parameters: every backend compiled in, SAFE and UNSAFE.

#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netio3/netio3.hpp>

namespace netio3::test {

struct BackendCase {
  BackendType type;
  ThreadSafetyModel model;
};

inline std::vector<BackendCase> backend_cases() {
  std::vector<BackendCase> out;
  for (const auto type : Netio3Backend::available()) {
    for (const auto model : {ThreadSafetyModel::SAFE, ThreadSafetyModel::UNSAFE}) {
      out.push_back({type, model});
    }
  }
  return out;
}

// "asyncmsg_safe", ...: for test names and measurement lines.
inline std::string backend_case_name(const BackendCase& c) {
  return fmt::format("{}_{}", to_string(c.type), to_string(c.model));
}

inline std::string backend_case_name(const ::testing::TestParamInfo<BackendCase>& info) {
  return backend_case_name(info.param);
}

}  // namespace netio3::test
