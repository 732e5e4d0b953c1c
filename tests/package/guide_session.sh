#!/usr/bin/env bash
# The user guide's DAQ shape with sessions, as a user runs it: one event builder, two readouts
# streaming into it with --session 1, and every TCP connection between them killed mid-stream
# (ss -K). Every fragment must arrive once and in order (the builder checks), every send must
# complete (the readouts check), and the readouts must say they were interrupted and resumed.
# Usage: guide_session.sh DIR, where DIR holds example_event_builder and example_readout (built
# from examples/ against the installed packages by tools/run.sh, or a build tree's).
set -euo pipefail
bin=$1
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

# Waits (at most 30 s) until file $1 has a line matching $2.
wait_for() {
  for _ in $(seq 300); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "guide_session: no '$2' in $1:" >&2
  cat "$1" >&2
  return 1
}

"$bin/example_event_builder" --readouts 2 >"$out/builder" &
builder=$!
wait_for "$out/builder" "listening on"
port=$(sed -n 's/.*listening on [0-9.]*:\([0-9]*\).*/\1/p' "$out/builder")
pids=()
for r in 1 2; do
  "$bin/example_readout" --port "$port" --session 1 --seconds 3 >"$out/readout$r" &
  pids+=($!)
done
for r in 1 2; do wait_for "$out/readout$r" "connected to"; done
sleep 1 # mid-stream: the readouts send for 3 s
# Both ends of every connection to the builder's port (the kernel resets the peer of each).
killed=$(ss -K -t -n state established "( sport = :$port or dport = :$port )" | tail -n +2 | wc -l)
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
wait "$builder" || status=1
cat "$out/builder" "$out/readout1" "$out/readout2"
if [ "$killed" -gt 0 ]; then
  echo "guide_session: ss -K killed $killed sockets mid-stream"
  for r in 1 2; do
    grep -q "interrupted" "$out/readout$r" && grep -q "resumed after" "$out/readout$r" ||
      { echo "guide_session: readout $r did not report the interruption and the resume" >&2; status=1; }
  done
else
  echo "guide_session: ss -K killed nothing here (no INET_DIAG_DESTROY?): no cut was made"
fi
exit $status
