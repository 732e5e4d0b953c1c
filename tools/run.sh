#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs what is missing, builds, runs.
#
#   tools/run.sh demo            build (release) and run the loopback demo on asyncmsg
#   tools/run.sh test [PRESET]   build PRESET (release, debug, asan, tsan; default release)
#                                and run the whole test suite with ctest
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
    if ! ctest --preset "$preset" -j "$(nproc)"; then
      show_failures "build/$preset"
      exit 1
    fi
    ;;
  *)
    echo "usage: tools/run.sh demo [demo options] | tools/run.sh test [release|debug|asan|tsan]" >&2
    exit 2
    ;;
esac
