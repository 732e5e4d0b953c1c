// The programs shown in README.md, docs/guide.md and docs/python.md are the files in
// examples/ (and python/examples/) that the tests run on every backend: every code block
// tagged
//
//   <!-- example: examples/FILE.cpp [NAME] -->      the lines between the two "// [NAME]"
//   ```cpp                                          lines of FILE (dedented, marker lines
//   ...                                             of nested excerpts left out); in Python
//   ```                                             files the markers are "# [NAME]" and the
//                                                   block is ```python
//
// or "<!-- example: examples/FILE.cpp -->" (the whole file) must be exactly that text.

#include <algorithm>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace {

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in{path};
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// A name of lower-case letters and underscores.
bool is_name(std::string_view s) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= 'a' && c <= 'z') || c == '_'; });
}

// "// [name]" (or "# [name]") on a line of its own. (No std::regex: GCC 12 warns
// -Wmaybe-uninitialized inside it under ASan.)
std::optional<std::string> marker_name(const std::string& line) {
  const std::string trimmed = trim(line);
  std::string_view t = trimmed;
  if (t.starts_with("// ")) {
    t.remove_prefix(3);
  } else if (t.starts_with("# ")) {
    t.remove_prefix(2);
  } else {
    return std::nullopt;
  }
  if (t.size() < 3 || t.front() != '[' || t.back() != ']') return std::nullopt;
  t = t.substr(1, t.size() - 2);
  if (!is_name(t)) return std::nullopt;
  return std::string{t};
}

// "<!-- example: PATH [NAME] -->" or "<!-- example: PATH -->": the path and the name
// (empty for the whole file).
std::optional<std::pair<std::string, std::string>> example_tag(std::string_view line) {
  constexpr std::string_view OPEN = "<!-- example: ";
  constexpr std::string_view CLOSE = " -->";
  if (!line.starts_with(OPEN) || !line.ends_with(CLOSE)) return std::nullopt;
  line = line.substr(OPEN.size(), line.size() - OPEN.size() - CLOSE.size());
  const auto space = line.find(' ');
  if (space == std::string_view::npos) {
    if (line.empty()) return std::nullopt;
    return std::pair{std::string{line}, std::string{}};
  }
  std::string_view name = line.substr(space + 1);
  if (name.size() < 3 || name.front() != '[' || name.back() != ']') return std::nullopt;
  name = name.substr(1, name.size() - 2);
  if (!is_name(name)) return std::nullopt;
  return std::pair{std::string{line.substr(0, space)}, std::string{name}};
}

// The excerpt NAME of `lines` (see the top of this file); nullopt unless the marker is there
// exactly twice.
std::optional<std::vector<std::string>> excerpt(const std::vector<std::string>& lines,
                                                const std::string& name) {
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (marker_name(lines[i]) == name) at.push_back(i);
  }
  if (at.size() != 2) return std::nullopt;
  std::vector<std::string> out;
  for (std::size_t i = at[0] + 1; i < at[1]; ++i) {
    if (!marker_name(lines[i])) out.push_back(lines[i]);
  }
  std::size_t indent = std::string::npos;
  for (const auto& line : out) {
    if (!trim(line).empty()) indent = std::min(indent, line.find_first_not_of(' '));
  }
  for (auto& line : out) line = line.size() >= indent ? line.substr(indent) : trim(line);
  return out;
}

struct Block {
  std::string doc;
  std::size_t line;  // of the tag, 1-based
  std::string file;  // examples/...
  std::string name;  // empty: the whole file
  std::vector<std::string> text;
};

std::vector<Block> tagged_blocks(const std::string& doc) {
  const auto lines = read_lines(std::string{NETIO3_SOURCE_DIR} + "/" + doc);
  std::vector<Block> blocks;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const auto tag = example_tag(lines[i]);
    if (!tag) continue;
    Block b{doc, i + 1, tag->first, tag->second, {}};
    const std::string fence = b.file.ends_with(".py") ? "```python" : "```cpp";
    if (i + 1 >= lines.size() || lines[i + 1] != fence) {
      ADD_FAILURE() << doc << ":" << i + 1 << ": the tag is not followed by a " << fence
                    << " block";
      continue;
    }
    std::size_t j = i + 2;
    for (; j < lines.size() && lines[j] != "```"; ++j) b.text.push_back(lines[j]);
    if (j == lines.size()) ADD_FAILURE() << doc << ":" << i + 1 << ": the block never ends";
    blocks.push_back(std::move(b));
    i = j;
  }
  return blocks;
}

const std::vector<std::string>& documents() {
  static const std::vector<std::string> DOCS{"README.md", "docs/guide.md", "docs/python.md"};
  return DOCS;
}

TEST(Docs, EveryProgramInTheDocsIsTheExampleFile) {
  std::size_t checked = 0;
  for (const auto& doc : documents()) {
    for (const auto& block : tagged_blocks(doc)) {
      const auto file = read_lines(std::string{NETIO3_SOURCE_DIR} + "/" + block.file);
      std::optional<std::vector<std::string>> want = file;
      if (!block.name.empty()) want = excerpt(file, block.name);
      const std::string where =
          fmt::format("{}:{} ({} [{}])", block.doc, block.line, block.file, block.name);
      ASSERT_TRUE(want.has_value())
          << where << ": the marker // [" << block.name << "] is not in the file exactly twice";
      for (std::size_t i = 0; i < std::max(want->size(), block.text.size()); ++i) {
        const std::string doc_line = i < block.text.size() ? block.text[i] : "<end of block>";
        const std::string file_line = i < want->size() ? (*want)[i] : "<end of excerpt>";
        ASSERT_EQ(doc_line, file_line) << where << ", line " << i + 1 << " of the block";
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 10U) << "the documents lost their tagged programs";
}

// Every program written for the docs is shown in them (and so kept in step with them).
TEST(Docs, EveryGuideProgramAppearsInTheDocs) {
  std::set<std::string> shown;
  for (const auto& doc : documents()) {
    for (const auto& block : tagged_blocks(doc)) shown.insert(block.file);
  }
  for (const char* file :
       {"examples/readme.cpp", "examples/guide_receiver.cpp", "examples/guide_sender.cpp",
        "examples/guide_threads.cpp", "examples/guide_shared_buffers.cpp",
        "examples/guide_errors.cpp", "python/examples/echo.py", "python/examples/callbacks.py",
        "python/examples/loop_thread.py", "python/examples/stream.py"}) {
    EXPECT_TRUE(shown.contains(file)) << file << " is in no document";
  }
}

// The checker itself: a changed line in an excerpt is caught.
TEST(Docs, TheCheckerSeesAChangedLine) {
  const std::vector<std::string> file{
      "int main() {", "  // [body]",  "  int x = 1;", "  // [inner]",
      "  return x;",  "  // [inner]", "  // [body]",  "}"};
  const auto body = excerpt(file, "body");
  ASSERT_TRUE(body.has_value());
  EXPECT_EQ(*body, (std::vector<std::string>{"int x = 1;", "return x;"}));
  EXPECT_NE(*body, (std::vector<std::string>{"int x = 2;", "return x;"}));
  EXPECT_FALSE(excerpt(file, "missing").has_value());
}

}  // namespace
