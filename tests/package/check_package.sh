#!/usr/bin/env bash
# Builds and runs tests/package/consumer against netio3 in both ways a project can use it:
# installed (find_package) and as a subdirectory (add_subdirectory).
# Usage: check_package.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
src=$1 build=$2 work=$3
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

cmake -S "$src/tests/package/consumer" -B "$work/subdir" "${gen[@]}" -DNETIO3_SOURCE_DIR="$src" >/dev/null
cmake --build "$work/subdir" --target consumer >/dev/null
"$work/subdir/consumer"
echo "check_package: find_package and add_subdirectory both work"
