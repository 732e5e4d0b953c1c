#!/usr/bin/env bash
# Builds and runs tests/package/consumer against netio3 in every way a project can use it
# (docs/guide.md, "Building against netio3"):
#  - installed to a prefix: find_package, and pkg-config with the rpath the guide shows; the
#    programs run without LD_LIBRARY_PATH, as does the installed netio3-perf;
#  - the build tree, not installed: find_package (netio3_DIR) and pkg-config
#    (pkgconfig/netio3-uninstalled.pc);
#  - add_subdirectory.
# Usage: check_package.sh SOURCE_DIR BUILD_DIR WORK_DIR CXX "BACKENDS"
set -euo pipefail
src=$1 build=$2 work=$3 cxx=$4 backends=$5
rm -rf "$work" && mkdir -p "$work"
gen=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
consumer=$src/tests/package/consumer
unset LD_LIBRARY_PATH

# ---- installed to a prefix ---------------------------------------------------------------
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
test -f "$prefix/include/netio3/netio3.hpp"
# Only the public API is installed.
if find "$prefix/include" -name '*.hpp' | grep -v '/netio3/' | grep -q .; then
  echo "private headers were installed" >&2; exit 1
fi
cmake -S "$consumer" -B "$work/find" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/find" >/dev/null
"$work/find/consumer"  # CMake recorded where the library is (build RPATH)

# pkg-config: the installed netio3.pc alone tells how to compile and link.
pc=$(find "$prefix" -name netio3.pc)
test -n "$pc" || { echo "netio3.pc was not installed" >&2; exit 1; }
version=$(sed -n 's/^#define NETIO3_VERSION_STRING "\(.*\)"$/\1/p' "$prefix/include/netio3/version.hpp")
(
  export PKG_CONFIG_PATH
  PKG_CONFIG_PATH=$(dirname "$pc")
  test "$(pkg-config --modversion netio3)" = "$version" ||
    { echo "netio3.pc says $(pkg-config --modversion netio3), version.hpp $version" >&2; exit 1; }
  # shellcheck disable=SC2046  # pkg-config's output is a list of words
  "$cxx" -std=c++20 "$consumer/main.cpp" -o "$work/pkg-config-consumer" \
    $(pkg-config --cflags --libs netio3) -Wl,-rpath,"$(pkg-config --variable=libdir netio3)"
  "$work/pkg-config-consumer"
  # A static link needs the transports netio3 was built with.
  static=$(pkg-config --static --libs netio3)
  for pair in "LIBFABRIC:-lfabric" "UCX:-lucp"; do
    if [[ " $backends " == *"${pair%%:*}"* && " $static " != *" ${pair#*:} "* ]]; then
      echo "pkg-config --static --libs netio3 lacks ${pair#*:}: $static" >&2; exit 1
    fi
  done
)
# The installed netio3-perf finds the installed library ($ORIGIN/../lib).
"$prefix/bin/netio3-perf" --loopback --backend asyncmsg --duration 0.2 --size 1k --quiet >/dev/null

# ---- the build tree, not installed -------------------------------------------------------
# No .pc file of the build tree points at paths that exist only once installed.
if [[ -e "$build/netio3.pc" || -e "$build/pkgconfig/netio3.pc" ]]; then
  echo "the build tree has a netio3.pc with installed paths" >&2; exit 1
fi
cmake -S "$consumer" -B "$work/build-tree" "${gen[@]}" -Dnetio3_DIR="$build" >/dev/null
cmake --build "$work/build-tree" >/dev/null
"$work/build-tree/consumer"
(
  export PKG_CONFIG_PATH=$build/pkgconfig
  test "$(pkg-config --modversion netio3)" = "$version"
  # shellcheck disable=SC2046
  "$cxx" -std=c++20 "$consumer/main.cpp" -o "$work/build-tree-pkg-config-consumer" \
    $(pkg-config --cflags --libs netio3) -Wl,-rpath,"$(pkg-config --variable=libdir netio3)"
  "$work/build-tree-pkg-config-consumer"
)

# ---- add_subdirectory --------------------------------------------------------------------
# What this checks is the CMake integration (targets, include folders, the options of a
# subproject), not the transports: asyncmsg only and no optimisation, to build it quickly.
cmake -S "$consumer" -B "$work/subdir" -G Ninja -DNETIO3_SOURCE_DIR="$src" \
  -DNETIO3_WITH_LIBFABRIC=OFF -DNETIO3_WITH_UCX=OFF >/dev/null
cmake --build "$work/subdir" --target consumer >/dev/null
"$work/subdir/consumer"
echo "check_package: installed (find_package, pkg-config, netio3-perf), build tree" \
  "(find_package, pkg-config) and add_subdirectory work"
