// main() of netio3-microbench: Google Benchmark's, plus a non-zero exit status when a
// benchmark found a wrong result (see bench::fail), so the ctest smoke test catches it.

#include <benchmark/benchmark.h>

#include "bench_util.hpp"

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return netio3::bench::g_failed.load() ? 1 : 0;
}
