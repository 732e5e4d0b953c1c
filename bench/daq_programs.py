#!/usr/bin/env python3
"""bench/daq_programs.py: the programs a DAQ user writes against netio3-perf, same run.

One readout (examples/readout.cpp) streams fragments zero-copy into one event builder
(examples/event_builder.cpp) - two plain programs of the user guide's shape, default
allocator, no tuning - and netio3-perf's client streams the same sizes zero-copy into its
server. Both pairs run in turn, ROUNDS times per backend and size, the receiver pinned to one
CPU and the sender to another (as bench/compare pins its rows); each run lasts SECONDS. The
receiver's rate is compared: the builder's (first to last fragment) against the rate
netio3-perf reports (the client's, of messages the server received whole).

  bench/daq_programs.py [--build build/release] [--backends asyncmsg,libfabric,ucx]
                        [--sizes 4096,1048576] [--rounds 5] [--seconds 3]

Prints one line per run and a table of medians: builder MB/s, netio3-perf MB/s, and the
median and range of the per-round ratios builder / netio3-perf. Exit status 0 when every
run finished, 1 otherwise (a program failed or a readout lost fragments).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pinned(cpu, argv):
    cpus = os.sched_getaffinity(0)
    return (["taskset", "-c", str(cpu)] + argv) if len(cpus) > 1 and cpu in cpus else argv


def start_receiver(argv, pattern):
    """Starts a receiver; returns (process, host:port) once it printed where it listens."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(pattern, line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError(f"{argv[0]} did not say where it listens")


def run_programs(build, backend, size, seconds):
    builder, address = start_receiver(
        pinned(0, [str(build / "examples/example_event_builder"), "--backend", backend,
                   "--size", str(size)]),
        r"^listening on ([0-9.]+:[0-9]+)")
    port = address.split(":")[1]
    readout = subprocess.run(
        pinned(1, [str(build / "examples/example_readout"), "--backend", backend, "--port", port,
                   "--size", str(size), "--seconds", str(seconds), "--fragments", "0"]),
        capture_output=True, text=True, timeout=seconds + 60)
    out, _ = builder.communicate(timeout=60)
    m = re.search(r"^rate: ([0-9.]+) MB/s", out, re.M)
    if readout.returncode != 0 or builder.returncode != 0 or not m:
        raise RuntimeError(f"readout/builder failed:\n{readout.stdout}{readout.stderr}{out}")
    return float(m.group(1))


def run_perf(build, backend, size, seconds):
    perf = str(build / "tools/netio3-perf/netio3-perf")
    server, address = start_receiver(
        pinned(0, [perf, "--server", "--backend", backend, "--port", "0",
                   "--max-size", str(size + 64)]),
        r"listening on ([0-9.]+:[0-9]+)")
    try:
        client = subprocess.run(
            pinned(1, [perf, "--client", address, "--backend", backend, "--send", "zero-copy",
                       "--size", str(size), "--duration", str(seconds), "--quiet"]),
            capture_output=True, text=True, timeout=seconds + 60)
    finally:
        server.terminate()
        server.communicate(timeout=30)
    m = re.search(r"([0-9.]+) MB/s", client.stdout)
    if client.returncode != 0 or not m:
        raise RuntimeError(f"netio3-perf failed:\n{client.stdout}{client.stderr}")
    return float(m.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=str(ROOT / "build/release"))
    parser.add_argument("--backends", default="asyncmsg,libfabric,ucx")
    parser.add_argument("--sizes", default="4096,1048576")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=3)
    args = parser.parse_args()
    build = Path(args.build)
    os.environ.setdefault("FI_PROVIDER", "tcp")  # no RDMA device here: libfabric over tcp
    rows = []
    ok = True
    for backend in args.backends.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            programs, perf = [], []
            for r in range(args.rounds):
                # In turn, the first of the pair alternating from round to round.
                order = [("programs", run_programs), ("perf", run_perf)]
                if r % 2:
                    order.reverse()
                for name, run in order:
                    try:
                        rate = run(build, backend, size, args.seconds)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        print(f"{backend} {size} B round {r + 1} {name}: {e}", file=sys.stderr)
                        ok = False
                        continue
                    (programs if name == "programs" else perf).append(rate)
                    print(f"{backend:9} {size:8} B round {r + 1} {name:8} {rate:9.1f} MB/s",
                          flush=True)
            if programs and perf:
                ratios = [a / b for a, b in zip(programs, perf)]
                rows.append((backend, size, statistics.median(programs), statistics.median(perf),
                             statistics.median(ratios), min(ratios), max(ratios)))
    print("\n| backend | size | readout -> builder MB/s | netio3-perf MB/s | ratio (median, range) |")
    print("|---|---|---|---|---|")
    for backend, size, a, b, ratio, lo, hi in rows:
        print(f"| {backend} | {size} | {a:.0f} | {b:.0f} | {ratio:.2f} ({lo:.2f}-{hi:.2f}) |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
