// netio3-raw-memcpy: the yardstick for moving large messages inside one host. One thread
// copies blocks of --size bytes from a source working set (--working-set bytes) into a
// destination working set (--target-set bytes, the same as the source unless given), block
// after block, round and round, for --duration seconds, the way a transport's receiver copies
// messages out of a sender's rotating buffers into its own. With a working set of one block
// both stay in the caches (what a reference that sends one buffer over and over measures);
// with many megabytes they come from memory (what a producer whose data arrive fresh sees).
// A destination of one block is a receiver that copies every message into the buffer it
// released last (netio3's UCX backend in RDMA mode).
//
//   netio3-raw-memcpy [--size N] [--working-set BYTES] [--target-set BYTES]
//                     [--duration SECONDS] [--json FILE]
//
// Sizes take k and m suffixes (KiB, MiB). Prints one line; with --json also appends one JSON
// record in netio3-perf's keys (tool "memcpy").

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace {

struct Options {
  std::size_t size{std::size_t{1} << 20U};
  std::size_t working_set{std::size_t{1} << 20U};
  std::size_t target_set{0};  // 0: the same as working_set
  double duration{3.0};
  std::string json;
};

[[noreturn]] void usage(std::string_view why) {
  std::fprintf(stderr,
               "netio3-raw-memcpy: %.*s\nusage: netio3-raw-memcpy [--size N] [--working-set "
               "BYTES] [--target-set BYTES] [--duration SECONDS] [--json FILE]\n",
               static_cast<int>(why.size()), why.data());
  std::exit(2);  // NOLINT(concurrency-mt-unsafe): single-threaded
}

std::optional<std::size_t> parse_size(std::string_view text) {
  if (text.empty()) return std::nullopt;
  std::size_t scale = 1;
  if (text.back() == 'k' || text.back() == 'K') scale = std::size_t{1} << 10U;
  if (text.back() == 'm' || text.back() == 'M') scale = std::size_t{1} << 20U;
  if (scale != 1) text.remove_suffix(1);
  std::size_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9' || value > (SIZE_MAX - 9) / 10) return std::nullopt;
    value = value * 10 + static_cast<std::size_t>(c - '0');
  }
  if (value == 0 || value > SIZE_MAX / scale) return std::nullopt;
  return value * scale;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view name = argv[i];
    if (i + 1 >= argc) usage(fmt::format("{} needs a value", name));
    const std::string_view value = argv[++i];
    if (name == "--size" || name == "--working-set" || name == "--target-set") {
      const auto n = parse_size(value);
      if (!n) usage(fmt::format("{} {}: not a size", name, value));
      (name == "--size" ? o.size : name == "--working-set" ? o.working_set : o.target_set) = *n;
    } else if (name == "--duration") {
      char* end = nullptr;
      o.duration = std::strtod(argv[i], &end);
      if (end == argv[i] || *end != '\0' || !(o.duration > 0)) usage("--duration: seconds > 0");
    } else if (name == "--json") {
      o.json = value;
    } else {
      usage(fmt::format("unknown option {}", name));
    }
  }
  if (o.target_set == 0) o.target_set = o.working_set;
  if (o.working_set < o.size) usage("--working-set: at least one block of --size bytes");
  if (o.target_set < o.size) usage("--target-set: at least one block of --size bytes");
  return o;
}

double cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

struct AlignedFree {
  void operator()(std::uint8_t* p) const noexcept { std::free(p); }  // NOLINT
};

std::unique_ptr<std::uint8_t[], AlignedFree> allocate(std::size_t bytes) {
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (p == nullptr) usage("out of memory");
  std::memset(p, 0x5a, bytes);  // every page faulted in before the clock starts
  return std::unique_ptr<std::uint8_t[], AlignedFree>{static_cast<std::uint8_t*>(p)};
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const std::size_t blocks = o.working_set / o.size;
  const std::size_t targets = o.target_set / o.size;
  const auto source = allocate(blocks * o.size);
  const auto target = allocate(targets * o.size);
  using Clock = std::chrono::steady_clock;
  // One round through both working sets before the clock starts (caches as in steady state).
  for (std::size_t b = 0; b < std::max(blocks, targets); ++b) {
    std::memcpy(target.get() + b % targets * o.size, source.get() + b % blocks * o.size, o.size);
  }
  const double cpu0 = cpu_seconds();
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration<double>(o.duration);
  std::uint64_t copies = 0;
  std::size_t b = 0;  // source block
  std::size_t t = 0;  // target block
  auto now = start;
  while (now < end) {
    // 16 copies between clock reads.
    for (int i = 0; i < 16; ++i) {
      std::memcpy(target.get() + t * o.size, source.get() + b * o.size, o.size);
      b = b + 1 == blocks ? 0 : b + 1;
      t = t + 1 == targets ? 0 : t + 1;
    }
    copies += 16;
    now = Clock::now();
  }
  const double seconds = std::chrono::duration<double>(now - start).count();
  const double cpu = cpu_seconds() - cpu0;
  // Something the compiler must keep: the last byte copied.
  const unsigned check = target[(t == 0 ? targets : t) * o.size - 1];
  const double per_s = static_cast<double>(copies) / seconds;
  const double bytes_per_s = per_s * static_cast<double>(o.size);
  std::printf(
      "memcpy %zu B blocks, working set %zu B (%zu blocks) into %zu B (%zu blocks): %.0f "
      "copies/s, %.2f GB/s, %.0f ns CPU per copy (check %u)\n",
      o.size, blocks * o.size, blocks, targets * o.size, targets, per_s, bytes_per_s / 1e9,
      cpu / static_cast<double>(copies) * 1e9, check);
  if (!o.json.empty()) {
    std::FILE* f = std::fopen(o.json.c_str(), "a");
    if (f == nullptr) {
      std::perror(o.json.c_str());
      return 3;
    }
    const std::string line = fmt::format(
        R"({{"tool":"memcpy","backend":"memory","mode":"","send":"memcpy","test":"throughput",)"
        R"("size":{},"connections":1,"threads":1,"working_set":{},"target_set":{},"duration_s":{},)"
        R"("messages":{},)"
        R"("bytes":{},"msgs_per_s":{},"bytes_per_s":{},"gbit_per_s":{},"cpu_ns_per_msg":{},)"
        R"("p50_us":null,"p99_us":null,"p999_us":null,"intact":true,"error":""}})"
        "\n",
        o.size, blocks * o.size, targets * o.size, seconds, copies, copies * o.size, per_s,
        bytes_per_s, bytes_per_s * 8 / 1e9, cpu / static_cast<double>(copies) * 1e9);
    std::fputs(line.c_str(), f);
    std::fclose(f);
  }
  return 0;
}
