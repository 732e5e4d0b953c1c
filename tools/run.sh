#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs what is missing, builds, runs.
#
#   tools/run.sh demo            build (release) and run the loopback demo on asyncmsg
#   tools/run.sh test [PRESET]   build PRESET (release, debug, asan, tsan; default release)
#                                and run the whole test suite with ctest
#
# For CI (.ci/run) and packagers:
#   tools/run.sh plain CXX       the plain CMake Release build (no preset) with compiler CXX
#                                in build/plain-CXX, warnings as errors, whole suite
#   tools/run.sh lint DIR        clang-tidy (.clang-tidy) on the library's sources, with
#                                DIR's compile_commands.json, and the API reference
#                                (target docs, Doxygen warnings as errors)
#   tools/run.sh package DIR     cpack -G DEB in DIR, installs the packages with apt-get,
#                                runs the installed netio3-perf and builds a program with
#                                the installed netio3.pc
#
# Installing packages needs root (or sudo); nothing is installed when all are present.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(cmake ninja-build g++ pkg-config libboost-dev libfmt-dev libgtest-dev libgmock-dev
          libbenchmark-dev libfabric-dev libucx-dev clang libclang-rt-14-dev)

install_missing() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  echo "run.sh: installing ${missing[*]}"
  local sudo=()
  ((EUID == 0)) || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

build() {
  local preset=$1
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset"
}

# After a red run: the output of each failed test (its last 80 lines), at the end of the log
# where a CI summary that keeps only the tail still shows why.
show_failures() {
  local dir=$1/Testing/Temporary
  [[ -f $dir/LastTestsFailed.log && -f $dir/LastTest.log ]] || return 0
  local line name
  while IFS= read -r line; do
    name=${line#*:}
    printf '\n=== output of the failed test %s\n' "$name"
    awk -v name="$name" '
      $0 ~ "^[0-9]+/[0-9]+ Testing: " && substr($0, index($0, ": ") + 2) == name { on = 1; next }
      on && /^Test (Passed|Failed)|^"[^"]*" end time/ { exit }
      on { print }' "$dir/LastTest.log" | tail -n 80
  done <"$dir/LastTestsFailed.log"
}

# ctest over a build directory's whole suite (ARGS: how ctest finds it); on failure the
# failed tests' output, then exit 1.
suite() {
  local dir=$1
  shift
  if ! ctest "$@" -j "$(nproc)"; then
    show_failures "$dir"
    exit 1
  fi
}

cmd=${1:-}
case "$cmd" in
  demo)
    install_missing
    build release
    ./build/release/examples/netio3-demo "${@:2}"
    ;;
  test)
    preset=${2:-release}
    install_missing
    build "$preset"
    suite "build/$preset" --preset "$preset"
    ;;
  plain)
    cxx=${2:?usage: tools/run.sh plain CXX}
    install_missing
    dir=build/plain-$(basename "$cxx")
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" \
      -DNETIO3_WERROR=ON >/dev/null
    cmake --build "$dir"
    suite "$dir" --test-dir "$dir"
    ;;
  lint)
    dir=${2:?usage: tools/run.sh lint BUILD_DIR}
    PACKAGES+=(clang-tidy doxygen)
    install_missing
    # Only the library's own translation units; headers under include/ and src/ are
    # checked through them (.clang-tidy HeaderFilterRegex).
    # run-clang-tidy 14 has no -warnings-as-errors: any finding in its output fails.
    tidy_log=$(mktemp)
    run-clang-tidy -p "$dir" -quiet "$PWD/src/.*\.cpp\$" 2>&1 | tee "$tidy_log"
    if grep -qE '(warning|error): ' "$tidy_log"; then
      echo "clang-tidy: $(grep -cE '(warning|error): ' "$tidy_log") finding(s)" >&2
      exit 1
    fi
    cmake --build "$dir" --target docs
    ;;
  package)
    dir=${2:?usage: tools/run.sh package BUILD_DIR}
    PACKAGES+=(dpkg-dev)
    install_missing
    rm -f "$dir"/*.deb
    (cd "$dir" && cpack -G DEB)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$PWD/$dir"/*.deb
    dpkg -L libnetio3-dev | grep -q 'netio3.pc$'
    netio3-perf --loopback --duration 1 --size 4k
    consumer=$(mktemp -d)
    g++ -std=c++20 -o "$consumer/consumer" tests/package/consumer/main.cpp \
      $(pkg-config --cflags --libs netio3)
    "$consumer/consumer"
    rm -rf "$consumer"
    ;;
  *)
    echo "usage: tools/run.sh demo [demo options] | tools/run.sh test [release|debug|asan|tsan]" >&2
    exit 2
    ;;
esac
