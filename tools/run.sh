#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs what is missing, builds, runs.
#
#   tools/run.sh demo            build the demo only (release preset) and run it: a loopback
#                                send/receive on asyncmsg
#   tools/run.sh test [PRESET]   build PRESET (release, debug, asan, tsan; default release)
#                                and run the whole test suite with ctest
#
# For CI (.ci/run) and packagers:
#   tools/run.sh plain CXX       the plain CMake Release build (no preset) with compiler CXX
#                                in build/plain-CXX, warnings as errors, whole suite; also
#                                builds the benchmark programs (target netio3_benchmarks),
#                                which no other build makes unless asked
#   tools/run.sh lint DIR        clang-format (.clang-format) over the C++ files outside the
#                                build folders,
#                                clang-tidy (.clang-tidy) on the library's sources, with
#                                DIR's compile_commands.json, and the API reference
#                                (target docs, Doxygen warnings as errors)
#   tools/run.sh package DIR     cpack -G DEB in DIR; installs the packages with apt-get in a
#                                fresh Debian 12 (debootstrap, minbase), runs the installed
#                                netio3-perf on every backend there and builds programs with
#                                the installed netio3.pc and CMake package
#
# Installing packages needs root (or sudo); nothing is installed when all are present. Each
# command installs what it needs and no more: demo and test the build's dependencies, the
# CI commands their own tools besides (clang for plain, which also brings the fuzz test;
# clang-format, clang-tidy and Doxygen for lint; debootstrap for package).
set -euo pipefail
cd "$(dirname "$0")/.."

# What the build needs (bench/compare reads this list too). The test libraries are small
# and the release preset's configuration needs them, so the demo installs them as well; so
# too Python's headers and pybind11, without which the configuration would leave the
# Python package out for good (a cached choice).
PACKAGES=(cmake ninja-build g++ pkg-config libboost-dev libfmt-dev libgtest-dev libgmock-dev
          libbenchmark-dev libfabric-dev libucx-dev libsodium-dev python3-dev pybind11-dev)
# What the Python package's tests need besides (tools/run.sh test).
PYTHON_TEST_PACKAGES=(python3-pytest python3-pytest-asyncio python3-pytest-timeout python3-numpy)

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

# ctest over a build directory's whole suite (DIR, JOBS, then ARGS: how ctest finds it); on
# failure the failed tests' output, then exit 1. The costliest tests start first (COST, then
# the timings of the last run). Two tests per core: most of the suite waits (for peers,
# timers, deadlines) rather than computes, so one per core leaves the machine half idle.
suite() {
  local dir=$1 jobs=$2
  shift 2
  if ! ctest "$@" -j "$jobs"; then
    show_failures "$dir"
    exit 1
  fi
}

# The Debian packages of build directory $1 in a fresh Debian 12 (debootstrap --variant=minbase
# bookworm): `apt-get install ./*.deb` must pull in every dependency they need; then the
# installed netio3-perf moves data on every backend, and a program builds and runs with
# pkg-config and with find_package. Needs root and a Debian mirror (DEBIAN_MIRROR).
fresh_debian() {
  local dir=$1 root
  root=$(mktemp -d /tmp/netio3-bookworm.XXXXXX)
  # Unmounted before it is removed; --one-file-system never follows a mount left behind.
  trap "umount -R '$root/proc' '$root/sys' '$root/dev' 2>/dev/null; rm -rf --one-file-system '$root'" EXIT
  echo "run.sh: a fresh Debian 12 in $root (debootstrap)"
  debootstrap --variant=minbase bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
    >"$root.log" 2>&1 || { tail -20 "$root.log"; return 1; }
  mkdir -p "$root/tmp/netio3"
  cp "$dir"/*.deb "$root/tmp/netio3/"
  cp -r tests/package/consumer "$root/tmp/netio3/"
  mkdir -p "$root/tmp/netio3/guide"
  cp examples/readout.cpp examples/event_builder.cpp examples/example_support.hpp \
    tests/package/guide_session.sh "$root/tmp/netio3/guide/"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  # UCX reads /sys/class/net; netio3-perf reads /proc.
  mount -t proc proc "$root/proc"
  mount -t sysfs sysfs "$root/sys"
  mount --rbind /dev "$root/dev"
  mount --make-rslave "$root/dev"
  chroot "$root" /bin/bash -euo pipefail -c '
    export DEBIAN_FRONTEND=noninteractive
    cd /tmp/netio3
    apt() { apt-get -o APT::Sandbox::User=root -y -qq "$@"; }
    apt update
    apt install --no-install-recommends ./*.deb >/dev/null
    echo "fresh Debian 12: installed $(ls *.deb | tr "\n" " ")"
    for backend in $(netio3-perf --list-backends); do
      netio3-perf --loopback --backend "$backend" --duration 1 --size 4k
    done
    if ls python3-netio3_*.deb >/dev/null 2>&1; then
      python3 -c "
import asyncio, netio3
async def main():
    async def echo(conn):
        await conn.send(await conn.recv())
    for backend in netio3.available():
        listener = await netio3.listen((\"127.0.0.1\", 0), echo, backend=backend)
        client = await netio3.connect(listener.address, backend=backend)
        await client.send(b\"round trip\")
        assert await client.recv() == b\"round trip\"
        await client.close()
        await listener.close()
        print(f\"python3-netio3: an asyncio round trip on {backend.name.lower()}\")
asyncio.run(main())"
    fi
    apt install --no-install-recommends g++ pkg-config cmake make iproute2 >/dev/null
    g++ -std=c++20 -o consumer-pc consumer/main.cpp $(pkg-config --cflags --libs netio3)
    ./consumer-pc
    cmake -S consumer -B consumer-cmake >/dev/null
    cmake --build consumer-cmake >/dev/null
    ./consumer-cmake/consumer
    # The user guide'"'"'s readout and event builder, built against the packages, with sessions
    # and every connection between them killed mid-stream.
    for program in readout event_builder; do
      g++ -std=c++20 -O2 -o guide/example_$program guide/$program.cpp \
        $(pkg-config --cflags --libs netio3)
    done
    guide/guide_session.sh guide'
  umount -R "$root/proc" "$root/sys" "$root/dev"
  rm -rf --one-file-system "$root" "$root.log"
  trap - EXIT
}

cmd=${1:-}
case "$cmd" in
  demo)
    install_missing
    cmake --preset release >/dev/null
    cmake --build --preset release --target netio3-demo
    ./build/release/examples/netio3-demo "${@:2}"
    ;;
  test)
    preset=${2:-release}
    PACKAGES+=("${PYTHON_TEST_PACKAGES[@]}")
    install_missing
    build "$preset"
    # Under TSan (5-15 times slower) one test per core: with two, set-up deadlines and stream
    # checks of the hostile and fault suites ran out (2 of 1035 in one run).
    jobs=$((2 * $(nproc)))
    [[ $preset == tsan ]] && jobs=$(nproc)
    suite "build/$preset" "$jobs" --preset "$preset"
    ;;
  plain)
    cxx=${2:?usage: tools/run.sh plain CXX}
    # clang (and its libFuzzer runtime: the fuzz test is built where clang is installed).
    PACKAGES+=("${PYTHON_TEST_PACKAGES[@]}" clang libclang-rt-14-dev)
    install_missing
    dir=build/plain-$(basename "$cxx")
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" \
      -DNETIO3_WERROR=ON >/dev/null
    cmake --build "$dir" --target all netio3_benchmarks
    suite "$dir" "$((2 * $(nproc)))" --test-dir "$dir"
    ;;
  lint)
    dir=${2:?usage: tools/run.sh lint BUILD_DIR}
    PACKAGES+=(clang-tidy clang-format doxygen)
    install_missing
    # The tree keeps its format (.clang-format): every C++ file outside the build folders.
    find . \( -name 'build*' -o -name '.*' ! -name . \) -prune -o \
      \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' \) -print0 |
      xargs -0 clang-format --dry-run -Werror
    # Only the library's own translation units; headers under include/ and src/ are
    # checked through them (.clang-tidy HeaderFilterRegex).
    # run-clang-tidy 14 has no -warnings-as-errors: any finding in its output fails.
    tidy_log=$(mktemp)
    run-clang-tidy -p "$dir" -quiet "$PWD/src/.*\.cpp\$" 2>&1 | tee "$tidy_log"
    if grep -qE '(warning|error): ' "$tidy_log"; then
      echo "clang-tidy: $(grep -cE '(warning|error): ' "$tidy_log") finding(s)" >&2
      exit 1
    fi
    # DIR was configured before Doxygen was installed (CI's clang++ stage runs first on a
    # fresh machine), and the docs target exists only where Doxygen was found: configure
    # again, which looks for it anew.
    cmake "$dir" >/dev/null
    cmake --build "$dir" --target docs
    ;;
  package)
    dir=${2:?usage: tools/run.sh package BUILD_DIR}
    PACKAGES+=(dpkg-dev debootstrap file)  # file: CPack DEB's shlibdeps
    install_missing
    rm -f "$dir"/*.deb
    (cd "$dir" && cpack -G DEB)
    fresh_debian "$dir"
    ;;
  *)
    echo "usage: tools/run.sh demo [demo options] | tools/run.sh test [release|debug|asan|tsan]" >&2
    exit 2
    ;;
esac
