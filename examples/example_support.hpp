#pragma once

// Helpers shared by the documentation examples and the demo. They are not part of what the
// documentation shows.
//
// Options: command-line handling: the documented snippets hard-code the backend
// (BackendType::ASYNCMSG or BackendType::LIBFABRIC), an `ip` and a `port`; the programs
// take them from the command line instead, so the same program runs on every backend.
//
// Options are "--name value" or "--name=value". Every program accepts --backend NAME
// (parsed with netio3::parse_backend_type, default "asyncmsg") and --help.

#include <charconv>
#include <cstdint>
#include <initializer_list>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>
#include <netio3/netio3.hpp>

namespace example {

class Options {
 public:
  // `known` maps each option name (without "--") to its default value. Prints the usage and
  // returns nullopt for --help, an unknown option or a missing value.
  static std::optional<Options> parse(
      int argc, char** argv, std::initializer_list<std::pair<std::string, std::string>> known) {
    Options options;
    options.m_values.emplace("backend", "asyncmsg");
    for (const auto& [name, value] : known) options.m_values.insert_or_assign(name, value);
    const std::string program = argc > 0 ? argv[0] : "example";
    const auto usage = [&] {
      std::cerr << fmt::format("usage: {}", program);
      for (const auto& [name, value] : options.m_values) {
        std::cerr << fmt::format(" [--{} VALUE (default '{}')]", name, value);
      }
      std::cerr << '\n';
    };
    for (int i = 1; i < argc; ++i) {
      std::string_view arg = argv[i];
      if (arg == "--help" || arg == "-h" || !arg.starts_with("--")) {
        usage();
        return std::nullopt;
      }
      arg.remove_prefix(2);
      std::string name;
      std::string value;
      if (const auto eq = arg.find('='); eq != std::string_view::npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
      } else if (i + 1 < argc) {
        name = arg;
        value = argv[++i];
      } else {
        std::cerr << fmt::format("{}: option --{} needs a value\n", program, arg);
        usage();
        return std::nullopt;
      }
      const auto it = options.m_values.find(name);
      if (it == options.m_values.end()) {
        std::cerr << fmt::format("{}: unknown option --{}\n", program, name);
        usage();
        return std::nullopt;
      }
      it->second = value;
    }
    return options;
  }

  [[nodiscard]] const std::string& str(const std::string& name) const { return m_values.at(name); }

  // The unsigned number given for `name`, or nullopt (with a message) if it is not one.
  template <typename T>
  [[nodiscard]] std::optional<T> number(const std::string& name) const {
    const std::string& text = m_values.at(name);
    T value{};
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc{} || end != text.data() + text.size()) {
      std::cerr << fmt::format("--{}: '{}' is not a valid number\n", name, text);
      return std::nullopt;
    }
    return value;
  }

  // --backend, parsed with netio3::parse_backend_type.
  [[nodiscard]] std::optional<netio3::BackendType> backend() const {
    const auto type = netio3::parse_backend_type(str("backend"));
    if (!type) {
      std::cerr << fmt::format("--backend: unknown backend '{}' (asyncmsg, libfabric, ucx)\n",
                               str("backend"));
    }
    return type;
  }

 private:
  std::map<std::string, std::string> m_values;
};

// The documented examples run the loop in a std::jthread and call evloop->stop() at the
// end. A jthread joins when destroyed, so every other way out of main (an early return on a
// failed check, an exception) must stop the loop too, or the program would hang. Declare
// the guard right after the thread: it is destroyed first.
class StopLoopOnExit {
 public:
  explicit StopLoopOnExit(std::shared_ptr<netio3::BaseEventLoop> loop) : m_loop{std::move(loop)} {}
  StopLoopOnExit(const StopLoopOnExit&) = delete;
  StopLoopOnExit& operator=(const StopLoopOnExit&) = delete;
  StopLoopOnExit(StopLoopOnExit&&) = delete;
  StopLoopOnExit& operator=(StopLoopOnExit&&) = delete;
  ~StopLoopOnExit() { m_loop->stop(); }

 private:
  std::shared_ptr<netio3::BaseEventLoop> m_loop;
};

}  // namespace example
