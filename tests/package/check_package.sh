#!/usr/bin/env bash
# Builds and runs tests/package/consumer against netio3 in every way a project can use it:
# installed (find_package, or pkg-config for a project that is not CMake-based) and as a
# subdirectory (add_subdirectory).
# Usage: check_package.sh SOURCE_DIR BUILD_DIR WORK_DIR CXX "BACKENDS"
set -euo pipefail
src=$1 build=$2 work=$3 cxx=$4 backends=$5
rm -rf "$work" && mkdir -p "$work"
gen=(-G Ninja -DCMAKE_BUILD_TYPE=Release)

cmake --install "$build" --prefix "$work/prefix" >/dev/null
test -f "$work/prefix/include/netio3/netio3.hpp"
# Only the public API is installed.
if find "$work/prefix/include" -name '*.hpp' | grep -v '/netio3/' | grep -q .; then
  echo "private headers were installed" >&2; exit 1
fi
cmake -S "$src/tests/package/consumer" -B "$work/find" "${gen[@]}" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/find" >/dev/null
LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$work/find/consumer"

# pkg-config: the installed netio3.pc alone tells how to compile and link.
pc=$(find "$work/prefix" -name netio3.pc)
test -n "$pc" || { echo "netio3.pc was not installed" >&2; exit 1; }
export PKG_CONFIG_PATH
PKG_CONFIG_PATH=$(dirname "$pc")
version=$(sed -n 's/^#define NETIO3_VERSION_STRING "\(.*\)"$/\1/p' "$work/prefix/include/netio3/version.hpp")
test "$(pkg-config --modversion netio3)" = "$version" ||
  { echo "netio3.pc says $(pkg-config --modversion netio3), version.hpp $version" >&2; exit 1; }
# shellcheck disable=SC2046  # pkg-config's output is a list of words
"$cxx" -std=c++20 "$src/tests/package/consumer/main.cpp" -o "$work/pkg-config-consumer" \
  $(pkg-config --cflags --libs netio3)
LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$work/pkg-config-consumer"
# A static link needs the transports netio3 was built with.
static=$(pkg-config --static --libs netio3)
for pair in "LIBFABRIC:-lfabric" "UCX:-lucp"; do
  if [[ " $backends " == *"${pair%%:*}"* && " $static " != *" ${pair#*:} "* ]]; then
    echo "pkg-config --static --libs netio3 lacks ${pair#*:}: $static" >&2; exit 1
  fi
done

cmake -S "$src/tests/package/consumer" -B "$work/subdir" "${gen[@]}" -DNETIO3_SOURCE_DIR="$src" >/dev/null
cmake --build "$work/subdir" --target consumer >/dev/null
"$work/subdir/consumer"
echo "check_package: find_package, pkg-config and add_subdirectory work"
