#!/usr/bin/env python3
"""bench/compare.py: runs every netio3 backend (netio3-perf) and the raw transport references
on this machine over loopback, and compares them. Started by bench/compare, which installs
the tools and builds first; see docs/benchmarks.md.

Every run is two processes on 127.0.0.1: a server in the background, a client in the
foreground. The whole plan runs in --repeat rounds; every round runs every group once, the
groups in the opposite order in every other round, so that a netio3 run and its reference are
taken close in time and neither always goes first. All records go to OUT/results.jsonl in the
common keys of the bench programs (references converted), each with its `round`; the tables
(printed and written as OUT/ratios.md) and OUT/compare.png (throughput and message rate
against message size) use the median over the rounds, the ratio table also the range of the
per-round ratios. Server and client output is kept in OUT/logs/.

Exit status: 0 done (whatever the ratios say), 1 a netio3 run reported lost or damaged data,
3 a netio3 run failed (crash, timeout, no result), 2 bad options.
"""

import argparse
import ctypes
import datetime
import json
import os
import platform
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
SIZES = [64, 4096, 65536, 1048576]
LATENCY_SIZES = [64, 4096]
MAX_SIZE = 1048576 + 64  # netio3-perf --max-size: the largest message plus room for headers
COPY_BACKENDS = {"asyncmsg", "ucx"}  # send_data_copy is supported there
SOCKPERF_MAX = 1048575  # sockperf's largest -m
GROUPS = ["netio3", "iperf3", "sockperf", "ucx_perftest", "raw-fabric", "zmq", "same-host",
          "fan-in", "python"]
# The order of one round: (group, netio3 backend or None). Each netio3 backend sits next to
# its references; every other round runs this list backwards.
ROUND_ORDER = [("netio3", "asyncmsg"), ("iperf3", None), ("sockperf", None), ("zmq", None),
               ("netio3", "ucx"), ("ucx_perftest", None), ("netio3", "libfabric"),
               ("raw-fabric", None), ("same-host", "ucx-rdma"), ("same-host", None),
               ("python", None)]
# The Python section: the netio3 package (python3 -m netio3.perf, asyncio layer and callback
# layer) next to netio3-perf (C++) and pyzmq's asyncio PUSH/PULL, all three with both ends in
# one process (netio3-perf --loopback), asyncmsg, the default window. Debian's interpreter: the
# package is built for it.
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
# The same-host section: two processes of one host, UCX in NetworkMode::RDMA (shared memory)
# against ucp_am_bw over UCX's shared-memory transports, both sleeping in the kernel between
# events (netio3 does not busy-poll here; ucx_perftest runs with -E sleep).
SHM_TLS = "posix,cma,self"
# ... and against the reference with netio3's error handling: ucp_am_bw with peer error
# handling (-e) over tcp and CMA, CMA's MEMORY_INVALIDATE on (what netio3 sets), and against a
# single-threaded memcpy of the same working set (netio3-raw-memcpy: the sender's blocks into
# one block, the receive buffer that netio3's receiver reuses). netio3's 1 MiB runs
# twice: with the default window (a rotating set of buffers at both ends, as a producer whose
# data come fresh from memory sees it) and with --window 1 (one buffer at each end, reused, as
# ucx_perftest and iperf3 send).
CMA_TLS = "tcp,cma"
SAME_HOST_W1_MIN = 65536  # --window 1 rows for sizes from this up
# Where the last-level cache holds the default window (8 x 1 MiB), "data fresh from memory" is
# not what the default window measures: at this size netio3 runs once more with a window of
# twice the last-level cache (the "beyond the cache" view), against a memcpy of that working
# set. Information, next to the default window's row.
BEYOND_CACHE_SIZE = 1048576


def last_level_cache():
    """Bytes of the largest CPU cache sysfs lists for CPU 0 (32 MiB when it lists none)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", text)
        if m:
            best = max(best, int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)])
    return best or 32 << 20


def beyond_cache_window(size):
    """netio3-perf's --window for the beyond-the-cache view: twice the last-level cache."""
    return min(max(-(-2 * last_level_cache() // size), 16), 1024)
# The fan-in section: one client process with N connections to one server process, every
# backend next to its raw transport with the same N (iperf3 -P N, netio3-raw-fabric and
# netio3-raw-ucx --connections N), buffered sends of one size. Every program there sleeps in the
# kernel when it has nothing to do (netio3 without busy polling, the raw programs with their
# fd/sleep waits, iperf3 as always), so that CPU per message means something at both ends. It
# runs once per round, after the size-by-size part (before it in every other round).
FAN_IN_CONNECTIONS = [1, 16, 128]
FAN_IN_SIZE = 4096
FAN_IN_BACKENDS = ["asyncmsg", "ucx", "libfabric"]
# The reference of each backend in the fan-in section (its label there).
FAN_IN_REFERENCE = {"asyncmsg": "iperf3 -P", "ucx": "raw-ucx", "libfabric": "raw-libfabric"}
# The target: msg/s at the most connections >= this times the 1-connection rate, or, where the
# reference drops as much, netio3 >= FAN_IN_VS_REFERENCE times the reference there.
FAN_IN_FLAT = 0.7
FAN_IN_VS_REFERENCE = 0.9

KEYS = ["tool", "backend", "mode", "send", "test", "size", "connections", "threads",
        "duration_s", "messages", "bytes", "msgs_per_s", "bytes_per_s", "gbit_per_s",
        "cpu_ns_per_msg", "p50_us", "p99_us", "p999_us", "intact"]


class RunError(Exception):
    """A run that produced no result; the message says why."""


def size_name(size):
    if size >= 1 << 20 and size % (1 << 20) == 0:
        return f"{size >> 20} MiB"
    if size >= 1 << 10 and size % (1 << 10) == 0:
        return f"{size >> 10} KiB"
    return f"{size} B"


def tail(text, lines=3, width=300):
    """The last non-empty lines of a tool's output, on one line: the error to report."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text or "")
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:])[-width:] or "no output"


def rel(path):
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return str(path)


def free_port():
    """A port that was free a moment ago: bind port 0, read it, close. Another process may
    take it before the server binds it; acceptable for a benchmark on a quiet machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_listening(port):
    """Whether some socket listens on TCP `port` (any address), from /proc/net/tcp{,6}."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except OSError:
            pass
    return False


# ---- background servers ------------------------------------------------------------------

_SERVERS = []


def _die_with_parent():
    # The server gets SIGTERM if this script dies, even by SIGKILL (Linux prctl).
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


# CPU pinning (--pin, the default where two CPUs are allowed): every server process runs on
# one CPU and every client on another, netio3 and the references alike. Left to the
# scheduler, the two processes of a run sometimes share a CPU for a while (busy-polling ones
# most), and a run then lands at about half the rate of the next: on the project's 2-CPU VM
# libfabric 1 MiB zero-copy ran at 35-72 Gbit/s unpinned, 56-69 pinned (docs/benchmarks.md).
PIN = {"client": None, "server": None, "both": None}  # "both": one process, both ends


def pin_cpus(enabled):
    """Chooses the client's and the server's CPU among those this process may use."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if enabled and len(cpus) >= 2:
        PIN["client"], PIN["server"] = cpus[0], cpus[1]
    else:
        PIN["client"] = PIN["server"] = None
    return PIN["client"], PIN["server"]


def _start_as(role):
    cpu = PIN[role]

    def start():
        _die_with_parent()
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
    return start


class Server:
    """A server process in the background; its output goes to a log file. Ready when it
    printed 'listening on IP:PORT' (netio3 programs) or when `port` is listening."""

    def __init__(self, name, argv, log_dir, env=None, port=None, timeout=30.0):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_dir) / f"server-{name}.log"
        self.lines = queue.Queue()
        self.address = None
        log = open(self.log_path, "a")
        log.write(f"$ {' '.join(self.argv)}\n")
        log.flush()
        try:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env=env, preexec_fn=_start_as("server"),
                                         start_new_session=True)
        except OSError as e:
            log.close()
            raise RunError(f"cannot start {self.argv[0]}: {e}") from e
        _SERVERS.append(self)
        self._reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while True:
            if port is not None and port_listening(port):
                self.address = f"{HOST}:{port}"
                return
            if port is None:
                try:
                    line = self.lines.get(timeout=0.05)
                    m = re.search(r"listening on (\S+):(\d+)", line)
                    if m:
                        ip = m.group(1)
                        ip = HOST if ip in ("0.0.0.0", "*", "::", "[::]") else ip
                        self.address = f"{ip}:{m.group(2)}"
                        return
                except queue.Empty:
                    pass
            else:
                time.sleep(0.05)
            if self.proc.poll() is not None:
                self._reader.join(1)
                raise RunError(f"{name} server exited ({self.proc.returncode}): "
                               f"{tail(self.log_path.read_text())}")
            if time.monotonic() > deadline:
                self.stop()
                raise RunError(f"{name} server not ready after {timeout:.0f} s: "
                               f"{tail(self.log_path.read_text())}")

    def _read(self, log):
        for line in self.proc.stdout:
            log.write(line)
            log.flush()
            self.lines.put(line)
        log.close()

    def alive(self):
        return self.proc.poll() is None

    def stop(self, timeout=5.0):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self in _SERVERS:
            _SERVERS.remove(self)

    def wait_exit(self, timeout):
        """For servers that end by themselves after one test (ucx_perftest)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.stop()


def stop_all_servers():
    for server in list(_SERVERS):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - keep going, stop the others
            pass


# ---- records -----------------------------------------------------------------------------

def record(label, group, **fields):
    """A record with every common key (None where a tool does not measure it)."""
    r = {k: None for k in KEYS}
    r.update(connections=1, threads=1, mode="tcp")
    r.update(fields)
    r["label"] = label
    r["group"] = group
    r.setdefault("status", "ok")
    r.setdefault("error", None)
    r.setdefault("note", None)
    if r.get("bytes_per_s") is not None and r.get("gbit_per_s") is None:
        r["gbit_per_s"] = r["bytes_per_s"] * 8 / 1e9
    return r


def failed(label, group, test, size, error, status="failed", **fields):
    return record(label, group, test=test, size=size, status=status, error=error, **fields)


class Runner:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.logs = self.out / "logs"
        self.runs = self.out / "runs"
        self.records = []
        self.build = Path(args.build_dir)
        self.bins = {
            "netio3-perf": self.build / "tools/netio3-perf/netio3-perf",
            "raw-fabric": self.build / "bench/raw/netio3-raw-fabric",
            "raw-zmq": self.build / "bench/raw/netio3-raw-zmq",
            "raw-ucx": self.build / "bench/raw/netio3-raw-ucx",
            "raw-memcpy": self.build / "bench/raw/netio3-raw-memcpy",
        }
        self.count = 0
        self.round = 1
        self.available = None  # backends netio3-perf was built with, asked once

    # -- helpers --

    def env(self, **extra):
        env = dict(os.environ)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def add(self, r):
        r["round"] = self.round
        self.records.append(r)
        self.count += 1
        what = f"{r['label']} {r['test']} {size_name(r['size'])}"
        if r["status"] == "ok":
            if r["test"] == "latency":
                value = f"p50 round trip {r['p50_us']:.1f} us" if r["p50_us"] is not None else ""
            else:
                value = (f"{r['msgs_per_s']:,.0f} msg/s, {r['bytes_per_s'] / 1e6:,.1f} MB/s"
                         if r["msgs_per_s"] is not None else "")
            print(f"[{self.count:3}] r{self.round} {what:45} {value}", flush=True)
        else:
            print(f"[{self.count:3}] r{self.round} {what:45} {r['status'].upper()}: "
                  f"{r['error']}", flush=True)

    def client(self, name, argv, env=None, timeout=None, role="client"):
        """Runs a client to its end; returns (returncode, stdout+stderr). The output is
        kept in OUT/logs/client-NAME.log. role "both": a program that is its own server
        (one process, both ends), left unpinned."""
        argv = [str(a) for a in argv]
        timeout = timeout or self.args.duration * 3 + 60
        log = self.logs / f"client-{name}.log"
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout,
                                  preexec_fn=_start_as(role))
            output, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
                else (e.stdout or "")
            rc = None
            output += f"\n(killed after {timeout:.0f} s)"
        except OSError as e:
            raise RunError(f"cannot start {argv[0]}: {e}") from e
        with open(log, "a") as f:
            f.write(f"# round {self.round}\n$ {' '.join(argv)}\n{output}\n")
        if rc is None:
            raise RunError(f"timed out after {timeout:.0f} s: {tail(output)}")
        return rc, output

    def seconds(self):
        return max(1, round(self.args.duration))  # iperf3 and sockperf take whole seconds

    # -- netio3-perf and the raw programs: same CLI, JSON Lines output --

    def json_client(self, label, group, name, argv, env, test, size, role="client"):
        json_path = self.runs / f"{name}-r{self.round}.jsonl"
        json_path.unlink(missing_ok=True)
        rc, output = self.client(name, argv + ["--json", json_path], env=env, role=role)
        lines = json_path.read_text().splitlines() if json_path.exists() else []
        if not lines:
            raise RunError(f"exit {rc}, no result: {tail(output)}")
        data = json.loads(lines[-1])
        why = data.pop("error", None) or tail(output, 2)
        r = record(label, group, **data)
        # Exit 1: data lost, damaged or reordered (netio3-perf, raw programs); any other
        # non-zero exit: the run could not be done (netio3-perf: 3).
        if rc == 1 and r.get("intact") is False:
            r["status"] = "lost"
            r["error"] = f"data lost or damaged: {why}"
        elif rc != 0 or not r.get("intact"):
            r["status"] = "failed"
            r["error"] = f"exit {rc}: {why}"
        r["test"], r["size"] = test, size
        return r

    def live_server(self, server, name, argv, env):
        """`server` while it runs; else (it died, or there is none yet) a new one."""
        if server is not None and server.alive():
            return server
        if server is not None:
            server.stop()
        return Server(name, argv, self.logs, env=env)

    def run_json_suite(self, group, name, label_of, server_argv, client_argv, plan, env):
        """plan: list of (send, test, size). One server serves all of them; it is started
        again if it died."""
        server = None
        for send, test, size in plan:
            label = label_of(send, test)
            run_name = f"{name}-{send}-{test}-{size}"
            try:
                server = self.live_server(server, name, server_argv, env)
                argv = client_argv(server.address, send, test, size)
                self.add(self.json_client(label, group, run_name, argv, env, test, size))
            except RunError as e:
                self.add(failed(label, group, test, size, str(e)))
        if server is not None:
            server.stop()

    def netio3_plan(self, backend):
        """(send, test, size) of one backend: buffered, copy (where supported) and zero-copy
        throughput; buffered and copy latency."""
        sends = ["buffered", "copy"] if backend in COPY_BACKENDS else ["buffered"]
        return ([(s, "throughput", n) for n in self.sizes for s in sends + ["zero-copy"]] +
                [("zero-copy same", "throughput", n) for n in self.sizes
                 if n >= SAME_HOST_W1_MIN] +
                [(s, "latency", n) for n in self.latency_sizes for s in sends])

    def netio3(self, backend):
        """A netio3 backend; 'ucx-rdma' is UCX in NetworkMode::RDMA (the same-host section):
        zero-copy and buffered throughput, no busy polling, UCX's choice of transports."""
        rdma = backend == "ucx-rdma"
        label_backend, backend = backend, ("ucx" if rdma else backend)
        perf = self.bins["netio3-perf"]
        plan = ([(s, "throughput", n) for n in self.sizes for s in ("zero-copy", "buffered")] +
                [(s, "throughput", n) for n in self.sizes if n >= SAME_HOST_W1_MIN
                 for s in ("zero-copy w1", "zero-copy same")] +
                [(f"zero-copy w{beyond_cache_window(n)}", "throughput", n) for n in self.sizes
                 if n == BEYOND_CACHE_SIZE]
                if rdma else self.netio3_plan(backend))
        why = None
        if not perf.exists():
            why = f"{rel(perf)} not built"
        else:
            if self.available is None:
                try:
                    listed = subprocess.run([perf, "--list-backends"], capture_output=True,
                                            text=True, timeout=30).stdout
                except (OSError, subprocess.TimeoutExpired) as e:
                    listed = ""
                    print(f"netio3-perf --list-backends failed: {e}", file=sys.stderr)
                self.available = set(re.findall(r"[a-z]+", listed))
            if backend not in self.available:
                why = "backend not compiled in (netio3-perf --list-backends)"
        group = "same-host" if rdma else "netio3"
        if why:
            for send, test, size in plan:
                self.add(failed(f"{label_backend} {send}", group, test, size, why,
                                status="missing", tool="netio3-perf", backend=backend,
                                send=send))
            return
        # UCX over TCP for both processes, as for ucx_perftest; in RDMA mode UCX's own choice.
        if rdma:
            env = {k: v for k, v in self.env().items() if k != "UCX_TLS"}
        else:
            env = self.env(UCX_TLS="tcp") if backend == "ucx" else self.env()
        d = self.args.duration
        mode = "rdma" if rdma else "tcp"

        # Polling like the reference: ucx_perftest and netio3-raw-fabric busy-poll, so the
        # UCX and libfabric runs do too (EpollEventLoop busy_poll); iperf3, sockperf and
        # ZeroMQ sleep in the kernel, and so do asyncmsg and the same-host runs here.
        poll = self.args.busy_poll if backend in ("ucx", "libfabric") and not rdma else 0
        poll_args = ["--busy-poll", poll]

        def client_argv(address, send, test, size):
            # "zero-copy w1": --window 1 (one buffer at each end); "zero-copy same": every
            # payload from one buffer, the default window in flight (--same-buffer).
            extra = []
            if send.endswith(" same"):
                send, extra = send[:-len(" same")], ["--same-buffer"]
            send, _, window = send.partition(" w")
            extra += ["--window", window] if window else []
            return [perf, "--client", address, "--backend", backend, "--mode", mode,
                    "--send", send, "--size", size, "--duration", d, "--test", test] + \
                poll_args + extra

        self.run_json_suite(
            group, f"netio3-{label_backend}", lambda send, test: f"{label_backend} {send}",
            [perf, "--server", "--backend", backend, "--mode", mode, "--bind", HOST,
             "--max-size", MAX_SIZE] + poll_args, client_argv, plan, env)

    def raw(self, group, key, server_extra, labels):
        binary = self.bins[key]
        plan = ([("t", "throughput", n) for n in self.sizes] +
                [("l", "latency", n) for n in self.latency_sizes])
        if not binary.exists():
            for _, test, size in plan:
                self.add(failed(labels[test], group, test, size,
                                f"{rel(binary)} not built", status="missing"))
            return
        d = self.args.duration

        def client_argv(address, send, test, size):
            return [binary, "--client", address, "--test", test, "--size", size,
                    "--duration", d]

        self.run_json_suite(group, group, lambda send, test: labels[test],
                            [binary, "--server", "--port", "0"] + server_extra, client_argv,
                            plan, self.env())

    # -- iperf3 --

    def iperf3(self):
        label = "iperf3"
        try:
            port = free_port()
            server = Server("iperf3", ["iperf3", "-s", "-B", HOST, "-p", port], self.logs,
                            port=port)
        except RunError as e:
            for size in self.sizes:
                self.add(failed(label, "iperf3", "throughput", size, str(e), tool="iperf3"))
            return
        try:
            for size in self.sizes:
                try:
                    self.add(self.iperf3_run(server, port, size))
                except RunError as e:
                    self.add(failed(label, "iperf3", "throughput", size, str(e), tool="iperf3"))
        finally:
            server.stop()

    def iperf3_run(self, server, port, size, streams=1, label="iperf3", group="iperf3",
                   test="throughput"):
        if not server.alive():
            raise RunError("iperf3 server died")
        parallel = ["-P", streams] if streams > 1 else []
        rc, output = self.client(f"iperf3-{size}" + (f"-P{streams}" if streams > 1 else ""),
                                 ["iperf3", "-c", HOST, "-p", port, "-t", self.seconds(), "-l",
                                  size, "-J"] + parallel)
        try:
            data = json.loads(output[: output.rindex("}") + 1])
        except ValueError as e:
            raise RunError(f"exit {rc}, no JSON: {tail(output)}") from e
        if "error" in data:
            raise RunError(f"iperf3: {data['error']}")
        end = data["end"]
        received = end["sum_received"]
        seconds = received["seconds"]
        nbytes = received["bytes"]
        messages = nbytes / size  # writes of -l bytes; TCP keeps no message boundaries
        cpu = end.get("cpu_utilization_percent", {})
        per_msg = lambda pct: pct / 100 * seconds * 1e9 / messages if messages else None  # noqa
        return record(label, group, tool="iperf3", backend="tcp", send="stream", test=test,
                      size=size, connections=streams, duration_s=seconds,
                      messages=round(messages),
                      bytes=nbytes, msgs_per_s=messages / seconds,
                      bytes_per_s=received["bits_per_second"] / 8,
                      cpu_ns_per_msg=per_msg(cpu.get("host_total", 0)),
                      server_cpu_ns_per_msg=per_msg(cpu.get("remote_total", 0)),
                      note=(f"{streams} TCP streams" if streams > 1 else "single TCP stream")
                      + ", receiver's bytes; messages = bytes / -l")

    # -- sockperf --

    def sockperf(self):
        try:
            port = free_port()
            server = Server("sockperf", ["sockperf", "sr", "--tcp", "-i", HOST, "-p", port,
                                         "-m", SOCKPERF_MAX], self.logs, port=port)
        except RunError as e:
            for size in self.latency_sizes:
                self.add(failed("sockperf pp", "sockperf", "latency", size, str(e),
                                tool="sockperf"))
            for size in self.sizes:
                self.add(failed("sockperf tp", "sockperf", "throughput", size, str(e),
                                tool="sockperf"))
            return
        try:
            for test, sizes, run in (("latency", self.latency_sizes, self.sockperf_pp),
                                     ("throughput", self.sizes, self.sockperf_tp)):
                for size in sizes:
                    label = "sockperf pp" if test == "latency" else "sockperf tp"
                    try:
                        if not server.alive():
                            raise RunError("sockperf server died")
                        self.add(run(port, size))
                    except RunError as e:
                        self.add(failed(label, "sockperf", test, size, str(e), tool="sockperf"))
        finally:
            server.stop()

    def sockperf_pp(self, port, size):
        rc, output = self.client(f"sockperf-pp-{size}", [
            "sockperf", "pp", "--tcp", "-i", HOST, "-p", port, "-m", size, "-t", self.seconds()])
        text = re.sub(r"\x1b\[[0-9;]*m", "", output)
        valid = re.search(r"\[Valid Duration\] RunTime=([\d.]+) sec; SentMessages=(\d+); "
                          r"ReceivedMessages=(\d+)", text)
        pct = {float(p): float(v) for p, v in
               re.findall(r"percentile\s+([\d.]+)\s*=\s*([\d.]+)", text)}
        if rc != 0 or not valid or 50.0 not in pct:
            raise RunError(f"exit {rc}: {tail(output)}")
        seconds, messages = float(valid.group(1)), int(valid.group(3))
        bad = re.search(r"# dropped messages = (\d+); # duplicated messages = (\d+); "
                        r"# out-of-order messages = (\d+)", text)
        intact = bad is not None and all(int(x) == 0 for x in bad.groups())
        # sockperf prints one-way latency (round trip / 2): doubled here to a round trip.
        rt = lambda p: 2 * pct[p] if p in pct else None  # noqa: E731
        return record("sockperf pp", "sockperf", tool="sockperf", backend="tcp",
                      send="ping-pong", test="latency", size=size, duration_s=seconds,
                      messages=messages, bytes=messages * size, msgs_per_s=messages / seconds,
                      bytes_per_s=messages * size / seconds, p50_us=rt(50.0), p99_us=rt(99.0),
                      p999_us=rt(99.9), intact=intact, one_way_p50_us=pct[50.0],
                      note="round trip = 2 x sockperf's one-way latency")

    def sockperf_tp(self, port, size):
        m = min(size, SOCKPERF_MAX)
        rc, output = self.client(f"sockperf-tp-{size}", [
            "sockperf", "tp", "--tcp", "-i", HOST, "-p", port, "-m", m, "-t", self.seconds()])
        text = re.sub(r"\x1b\[[0-9;]*m", "", output)
        total = re.search(r"Total of (\d+) messages sent in ([\d.]+) sec", text)
        if rc != 0 or not total:
            raise RunError(f"exit {rc}: {tail(output)}")
        messages, seconds = int(total.group(1)), float(total.group(2))
        note = "sender's count (one way, not checked)"
        if m != size:
            note += f"; -m {m}: sockperf's largest message"
        return record("sockperf tp", "sockperf", tool="sockperf", backend="tcp",
                      send="throughput", test="throughput", size=size, duration_s=seconds,
                      messages=messages, bytes=messages * m, msgs_per_s=messages / seconds,
                      bytes_per_s=messages * m / seconds, note=note)

    # -- ucx_perftest --

    def ucx_perftest(self):
        if shutil.which("ucx_perftest") is None:
            for test, sizes in (("throughput", self.sizes), ("latency", self.latency_sizes)):
                for size in sizes:
                    label = "ucp_am_bw" if test == "throughput" else "ucp_am_lat"
                    self.add(failed(label, "ucx_perftest", test, size,
                                    "ucx_perftest not installed (ucx-utils)", status="missing"))
            return
        for test, sizes in (("throughput", self.sizes), ("latency", self.latency_sizes)):
            for size in sizes:
                label = "ucp_am_bw" if test == "throughput" else "ucp_am_lat"
                try:
                    self.add(self.ucx_run(label, test, size))
                except RunError as e:
                    self.add(failed(label, "ucx_perftest", test, size, str(e),
                                    tool="ucx_perftest", backend="ucx"))

    def ucx_reference_env(self):
        """UCX_TLS=tcp, and the tcp transport's PUT protocol as netio3's UCX backend uses it.

        netio3 turns tcp PUT zcopy off in its own UCP configuration unless UCX_TCP_PUT_ENABLE
        is set (UCX 1.13 aborts in it when a peer closes with rendezvous sends in flight;
        docs/ucx.md). ucx_perftest gets the same setting, so both sides of the ratio run the
        same rendezvous protocol."""
        put = os.environ.get("UCX_TCP_PUT_ENABLE", "n")
        return self.env(UCX_TLS="tcp", UCX_TCP_PUT_ENABLE=put), put

    def ucx_perftest_shm(self):
        """The same-host references: ucp_am_bw over UCX's shared-memory transports, and over
        tcp and CMA with peer error handling, both in sleep mode; a memcpy of netio3's working
        sets."""
        for size in self.sizes:
            # "-e cma O1": one send outstanding (-O 1), as netio3-perf's --window 1.
            kinds = [("shm", "ucp_am_bw shm"), ("cma", "ucp_am_bw -e cma")]
            if size >= SAME_HOST_W1_MIN:
                kinds.append(("cma1", "ucp_am_bw -e cma O1"))
            for shm, label in kinds:
                try:
                    self.add(self.ucx_run("ucp_am_bw", "throughput", size, shm=shm))
                except RunError as e:
                    self.add(failed(label, "same-host", "throughput", size, str(e),
                                    tool="ucx_perftest", backend="ucx"))
            self.memcpy(size)

    def memcpy(self, size):
        """netio3-raw-memcpy with one block (the references' working set), from netio3-perf's
        default window of blocks (its zero-copy slots) and, at BEYOND_CACHE_SIZE, from a window
        of twice the last-level cache. The copies from a window go into one block: the UCX
        backend fetches each message into the receive buffer released last, which
        netio3-perf's server releases as soon as it has counted the message."""
        binary = self.bins["raw-memcpy"]
        window = min(max((2 << 20) // size, 8), 1024)  # netio3-perf's auto_window
        runs = [(1, "memcpy ws1"), (window, "memcpy window")]
        if size == BEYOND_CACHE_SIZE:
            runs.append((beyond_cache_window(size), "memcpy beyond cache"))
        for blocks, label in runs:
            if not binary.exists():
                self.add(failed(label, "same-host", "throughput", size,
                                f"{rel(binary)} not built", status="missing"))
                continue
            try:
                r = self.json_client(label, "same-host", f"memcpy-{size}-{blocks}",
                                     [binary, "--size", size, "--working-set", blocks * size,
                                      "--target-set", size, "--duration", self.args.duration],
                                     self.env(), "throughput", size)
                r["note"] = f"working set {blocks} x {size_name(size)} into one block"
                self.add(r)
            except RunError as e:
                self.add(failed(label, "same-host", "throughput", size, str(e)))

    def ucx_once(self, label, size, iterations, tag, shm=False):
        """One ucx_perftest server + client; returns the numbers of its final line."""
        env, _ = self.ucx_reference_env()
        extra = []
        if shm in ("cma", "cma1"):
            env = dict(env, UCX_TLS=CMA_TLS, UCX_CMA_MEMORY_INVALIDATE="y")
            extra = ["-E", "sleep", "-e"]
            client_extra = ["-O", "1"] if shm == "cma1" else []
        elif shm:
            env = dict(env, UCX_TLS=SHM_TLS)
            env.pop("UCX_TCP_PUT_ENABLE", None)
            extra = ["-E", "sleep"]
        if shm not in ("cma", "cma1"):
            client_extra = []
        port = free_port()
        suffix = f"-{shm}" if shm else ""
        server = Server(f"ucx_perftest-{label}-{size}{suffix}",
                        ["ucx_perftest", "-p", port] + extra, self.logs, env=env, port=port)
        warmup = min(10000, max(10, iterations // 10))
        try:
            rc, output = self.client(
                f"ucx_perftest-{label}-{size}-{tag}{suffix}",
                ["ucx_perftest", HOST, "-p", port, "-t", label, "-s", size, "-n", iterations,
                 "-w", warmup, "-f"] + extra + client_extra, env=env)
        finally:
            server.wait_exit(5)
        # With -f the result is one line of 8 numbers ('Final:' in front without -f).
        final = re.findall(r"^(?:Final:)?\s*((?:[\d.]+\s+){7}[\d.]+)\s*$", output, re.M)
        if rc != 0 or not final:
            raise RunError(f"exit {rc}: {tail(output)}")
        return [float(v) for v in final[-1].split()]
        # iterations, p50 (or latency percentile), average, overall, MB/s average, overall,
        # msg/s average, overall

    def ucx_run(self, label, test, size, shm=False):
        # ucx_perftest runs a number of iterations, not a time: a short calibration run
        # first, then as many iterations as fit in --duration at the calibrated rate.
        if test == "throughput":
            guess = min(1e6, 1e9 / size)
            rate = lambda v: v[7]  # noqa: E731 - overall message rate
        else:
            guess = 20000.0
            rate = lambda v: 1e6 / (2 * v[3])  # noqa: E731 - round trips per second
        _, put = self.ucx_reference_env()
        calibration = self.ucx_once(label, size, max(20, int(guess * 0.2)), "calibration", shm)
        iterations = max(100, int(rate(calibration) * self.args.duration))
        v = self.ucx_once(label, size, iterations, "run", shm)
        if shm:
            per_s = v[7]
            cma = shm in ("cma", "cma1")
            name = {"cma": "ucp_am_bw -e cma", "cma1": "ucp_am_bw -e cma O1"}.get(shm,
                                                                                "ucp_am_bw shm")
            return record(name, "same-host",
                          tool="ucx_perftest", backend="ucx",
                          send="ucp_am_bw", test=test, size=size, duration_s=v[0] / per_s,
                          messages=int(v[0]), bytes=int(v[0]) * size, msgs_per_s=per_s,
                          bytes_per_s=per_s * size,
                          note=(f"UCX_TLS={CMA_TLS}, UCX_CMA_MEMORY_INVALIDATE=y, -e, -E sleep"
                                + (", -O 1" if shm == "cma1" else "")
                                if cma else f"UCX_TLS={SHM_TLS}, -E sleep") +
                          "; overall message rate")
        if test == "throughput":
            per_s = v[7]
            return record(label, "ucx_perftest", tool="ucx_perftest", backend="ucx",
                          send="ucp_am_bw", test=test, size=size, duration_s=v[0] / per_s,
                          messages=int(v[0]), bytes=int(v[0]) * size, msgs_per_s=per_s,
                          bytes_per_s=per_s * size,
                          note=f"UCX_TLS=tcp, UCX_TCP_PUT_ENABLE={put}; overall message rate")
        # Latency tests print half the round trip: doubled here.
        round_trips = 1e6 / (2 * v[3])
        return record(label, "ucx_perftest", tool="ucx_perftest", backend="ucx",
                      send="ucp_am_lat", test=test, size=size, duration_s=v[0] / round_trips,
                      messages=int(v[0]), bytes=int(v[0]) * size, msgs_per_s=round_trips,
                      bytes_per_s=round_trips * size, p50_us=2 * v[1], one_way_p50_us=v[1],
                      note=f"UCX_TLS=tcp, UCX_TCP_PUT_ENABLE={put}; "
                           "round trip = 2 x ucx_perftest's latency")

    # -- fan-in --

    def fan_in(self, backend):
        """One backend's fan-in rows: netio3 with each connection count, then its reference
        with the same counts (one server each, serving every count)."""
        size, counts = self.args.fan_in_size, self.args.fan_in
        perf = self.bins["netio3-perf"]
        d = self.args.duration
        poll_args = ["--busy-poll", 0]
        env = self.env(UCX_TLS="tcp") if backend == "ucx" else self.env()
        label = f"{backend} buffered"
        if not perf.exists():
            for n in counts:
                self.add(failed(f"{label} x{n}", "fan-in", "fan-in", size,
                                f"{rel(perf)} not built", status="missing", connections=n))
        else:
            self.fan_in_suite(
                label, f"fan-in-{backend}",
                [perf, "--server", "--backend", backend, "--bind", HOST, "--max-size", size]
                + poll_args,
                lambda address, n: [perf, "--client", address, "--backend", backend, "--send",
                                    "buffered", "--size", size, "--duration", d, "--test",
                                    "throughput", "--connections", n] + poll_args,
                counts, env, tool="netio3-perf", backend=backend)
        reference = FAN_IN_REFERENCE[backend]
        if backend == "asyncmsg":
            self.fan_in_iperf3(size, counts)
            return
        key = "raw-ucx" if backend == "ucx" else "raw-fabric"
        binary = self.bins[key]
        if not binary.exists():
            for n in counts:
                self.add(failed(f"{reference} x{n}", "fan-in", "fan-in", size,
                                f"{rel(binary)} not built", status="missing", connections=n))
            return
        if backend == "ucx":
            ref_env, _ = self.ucx_reference_env()
            wait = ["--wait", "sleep"]
            server = [binary, "--server", "--bind", HOST, "--port", "0", "--max-size", size]
        else:
            ref_env = self.env()
            wait = ["--wait", "fd"]
            server = [binary, "--server", "--port", "0", "--provider", "tcp"]
        self.fan_in_suite(
            reference, f"fan-in-{key}", server + wait,
            lambda address, n: [binary, "--client", address, "--test", "throughput", "--size",
                                size, "--duration", d, "--connections", n] + wait,
            counts, ref_env, tool=key, backend=backend)

    def fan_in_suite(self, label, name, server_argv, client_argv, counts, env, **fields):
        server = None
        size = self.args.fan_in_size
        for n in counts:
            run_label = f"{label} x{n}"
            try:
                server = self.live_server(server, name, server_argv, env)
                r = self.json_client(run_label, "fan-in", f"{name}-{n}",
                                     client_argv(server.address, n), env, "fan-in", size)
                r["connections"] = n
                self.add(r)
            except RunError as e:
                self.add(failed(run_label, "fan-in", "fan-in", size, str(e), connections=n,
                                **fields))
        if server is not None:
            server.stop()

    def fan_in_iperf3(self, size, counts):
        label = FAN_IN_REFERENCE["asyncmsg"]
        try:
            port = free_port()
            server = Server("iperf3-fan-in", ["iperf3", "-s", "-B", HOST, "-p", port], self.logs,
                            port=port)
        except RunError as e:
            for n in counts:
                self.add(failed(f"{label} x{n}", "fan-in", "fan-in", size, str(e),
                                tool="iperf3", connections=n))
            return
        try:
            for n in counts:
                try:
                    self.add(self.iperf3_run(server, port, size, streams=n,
                                             label=f"{label} x{n}", group="fan-in",
                                             test="fan-in"))
                except RunError as e:
                    self.add(failed(f"{label} x{n}", "fan-in", "fan-in", size, str(e),
                                    tool="iperf3", connections=n))
        finally:
            server.stop()

    # -- all --

    def python_section(self):
        """The Python package, throughput, asyncmsg, the default windows:
        - as a client of netio3-perf --server (C++), zero-copy, next to netio3-perf's own
          client against the same server: the senders compared;
        - both ends in one process on one asyncio loop, next to pyzmq's asyncio PUSH/PULL
          built the same way (bench/python/zmq_asyncio.py)."""
        perf = self.bins["netio3-perf"]
        env = self.env(PYTHONPATH=self.build / "python")
        d = self.args.duration
        server = None
        for size in self.sizes:
            try:
                server = self.live_server(
                    server, "python-server",
                    [perf, "--server", "--backend", "asyncmsg", "--mode", "tcp", "--bind", HOST,
                     "--max-size", MAX_SIZE], env)
                address = server.address
            except RunError as e:
                address = None
                for label in ("python asyncmsg zero-copy client", "netio3-perf asyncmsg zero-copy"):
                    self.add(failed(label, "python", "throughput", size, str(e)))
            runs = []
            if address is not None:
                runs += [
                    ("python asyncmsg zero-copy client", "py-client",
                     [PYTHON, "-m", "netio3.perf", "--client", address, "--send", "zero-copy",
                      "--size", size, "--duration", d]),
                    ("netio3-perf asyncmsg zero-copy", "cxx-client",
                     [perf, "--client", address, "--backend", "asyncmsg", "--send", "zero-copy",
                      "--size", size, "--duration", d]),
                ]
            runs += [
                ("python asyncmsg aio loopback", "py-aio",
                 [PYTHON, "-m", "netio3.perf", "--backend", "asyncmsg", "--size", size,
                  "--duration", d]),
                ("pyzmq asyncio push-pull", "pyzmq",
                 [PYTHON, ROOT / "bench/python/zmq_asyncio.py", "--size", size,
                  "--duration", d]),
            ]
            for label, name, argv in runs:
                # The loopback runs hold both ends in one process: not pinned to one CPU.
                role = "both" if name in ("py-aio", "pyzmq") else "client"
                try:
                    self.add(self.json_client(label, "python", f"{name}-{size}", argv, env,
                                              "throughput", size, role))
                except RunError as e:
                    self.add(failed(label, "python", "throughput", size, str(e)))
        if server is not None:
            server.stop()

    def units(self):
        """One round's steps, (name, function), in ROUND_ORDER, those --only picks."""
        steps = {
            "iperf3": self.iperf3,
            "sockperf": self.sockperf,
            "ucx_perftest": self.ucx_perftest,
            "raw-fabric": lambda: self.raw("raw-libfabric", "raw-fabric", ["--provider", "tcp"],
                                           {"throughput": "raw-libfabric",
                                            "latency": "raw-libfabric"}),
            "zmq": lambda: self.raw("zmq", "raw-zmq", ["--bind", HOST],
                                    {"throughput": "zmq push-pull", "latency": "zmq req-rep"}),
            "python": self.python_section,
        }
        units = []
        for group, backend in ROUND_ORDER:
            if group not in self.args.only:
                continue
            if backend is not None and backend.removesuffix("-rdma") not in self.args.backends:
                continue
            if backend is not None:
                units.append((f"netio3 {backend}", lambda b=backend: self.netio3(b)))
            elif group == "same-host":
                units.append(("ucp_am_bw shm", self.ucx_perftest_shm))
            else:
                units.append((group, steps[group]))
        return units

    def run(self):
        self.sizes = self.args.sizes
        self.latency_sizes = [s for s in LATENCY_SIZES if s in self.sizes] or self.sizes[:1]
        for d in (self.logs, self.runs):
            d.mkdir(parents=True, exist_ok=True)
        units = self.units()
        sizes, latency_sizes = self.sizes, self.latency_sizes
        rounds = self.args.repeat
        self.round_seconds = []
        for i in range(rounds):
            self.round = i + 1
            # Size by size, so that the two sides of a ratio run within a minute or so of each
            # other (this machine's speed drifts within minutes); every other round backwards.
            order = units if i % 2 == 0 else units[::-1]
            slices = sizes if i % 2 == 0 else sizes[::-1]
            print(f"-- round {self.round} of {rounds}: size by size "
                  f"({', '.join(size_name(n) for n in slices)}), each "
                  f"{', '.join(n for n, _ in order)}", flush=True)
            t0 = time.monotonic()
            fan_in = [lambda b=b: self.fan_in(b) for b in FAN_IN_BACKENDS
                      if b in self.args.backends] if "fan-in" in self.args.only else []
            if i % 2 == 1:
                for step in fan_in[::-1]:
                    step()
            for size in slices:
                self.sizes = [size]
                self.latency_sizes = [size] if size in latency_sizes else []
                for _, step in order:
                    step()
            if i % 2 == 0:
                for step in fan_in:
                    step()
            self.round_seconds.append(time.monotonic() - t0)
        self.sizes, self.latency_sizes = sizes, latency_sizes


# ---- ratios and tables -------------------------------------------------------------------

METRICS = {"bw": "bytes_per_s", "rate": "msgs_per_s", "p50": "p50_us"}


def median(values):
    """The median; with an even count the mean of the two middle values."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class Summary:
    """The rounds of one (label, test, size): the ok ones and the others, and the median over
    the ok rounds of every figure the tables show. A round that failed, lost data or is
    missing is left out of the medians."""

    def __init__(self, records):
        self.records = sorted(records, key=lambda r: r.get("round") or 0)
        first = self.records[0]
        self.label, self.group, self.test, self.size = (first["label"], first["group"],
                                                       first["test"], first["size"])
        self.ok = [r for r in self.records if r["status"] == "ok"]
        self.bad = [r for r in self.records if r["status"] != "ok"]

    def median(self, key):
        return median(r.get(key) for r in self.ok)

    def by_round(self, key):
        return {r["round"]: r.get(key) for r in self.ok if r.get(key) is not None}

    def status(self):
        """'ok' when every round was, else what went wrong in which round."""
        bad = [f"round {r['round']} {r['status']}: {r['error']}" for r in self.bad]
        if not self.ok:
            r = self.bad[0]
            rounds = f" (all {len(self.records)} rounds)" if len(self.records) > 1 else ""
            return f"{r['status']}{rounds}: {r['error']}"
        ok = "ok" if all(r.get("intact") is not None for r in self.ok) else "ok (not checked)"
        if bad:
            ok += f"; {len(self.ok)} of {len(self.records)} rounds in the median; " + \
                "; ".join(bad)
        return ok


def summarize(records):
    """{(label, test, size): Summary}, in the order the records first appear."""
    groups = {}
    for r in records:
        groups.setdefault((r["label"], r["test"], r["size"]), []).append(r)
    return {k: Summary(v) for k, v in groups.items()}


def ratio_rows(summaries, sizes, latency_sizes, rounds):
    """(what, size, median ratio or None, per-round ratios {round: ratio}, target, verdict).
    The ratio is the median of the numerator's rounds over the median of the reference's;
    the per-round ratios pair round r of one with round r of the other."""
    specs = []
    # At 1 MiB the targets judge equal working sets: iperf3, ucx_perftest and the raw
    # programs send one buffer over and over (it stays in cache); "zero-copy same" does too
    # (netio3-perf --same-buffer), and copy sends copy from one source (the copy they ask
    # for is their extra cost). "zero-copy" (the default window, a new slot per message) and
    # "buffered" (the window's pool buffers, 8 x 1 MiB, each in flight until sent) rotate
    # through the window as a producer with data fresh from memory does: information here,
    # judged against a memcpy of their working set in the same-host section.
    def window_working_set(send, size):
        return size == 1048576 and send in ("zero-copy", "buffered")

    for send in ("buffered", "copy", "zero-copy", "zero-copy same"):
        for size in sizes:
            if send == "zero-copy same" and size < SAME_HOST_W1_MIN:
                continue
            specs.append((f"asyncmsg {send} / iperf3 bandwidth", size, f"asyncmsg {send}",
                          "throughput", "iperf3", "throughput", "bw",
                          (">=", 0.9) if size == 1048576 and not window_working_set(send, size)
                          else None))
    for send in ("copy", "buffered"):
        if 64 in sizes:
            specs.append((f"asyncmsg {send} / zmq push-pull msg rate", 64, f"asyncmsg {send}",
                          "throughput", "zmq push-pull", "throughput", "rate", (">=", 1.0)))
    for send in ("buffered", "copy"):
        for size in latency_sizes:
            specs.append((f"asyncmsg {send} / sockperf latency p50", size, f"asyncmsg {send}",
                          "latency", "sockperf pp", "latency", "p50", ("<=", 1.3)))
    ucx_target = {64: (">=", 0.8), 65536: (">=", 0.9), 1048576: (">=", 0.9)}

    def equal_ws_target(send, size):
        if send == "zero-copy same" and size < SAME_HOST_W1_MIN:
            return "skip"
        return None if window_working_set(send, size) else ucx_target.get(size)

    for send in ("buffered", "copy", "zero-copy", "zero-copy same"):
        for size in sizes:
            target = equal_ws_target(send, size)
            if target != "skip":
                specs.append((f"ucx {send} / ucp_am_bw msg rate", size, f"ucx {send}",
                              "throughput", "ucp_am_bw", "throughput", "rate", target))
    for send in ("buffered", "copy"):
        for size in latency_sizes:
            specs.append((f"ucx {send} / ucp_am_lat latency p50", size, f"ucx {send}",
                          "latency", "ucp_am_lat", "latency", "p50", ("<=", 1.3)))
    for send in ("buffered", "zero-copy", "zero-copy same"):
        for size in sizes:
            target = equal_ws_target(send, size)
            if target != "skip":
                specs.append((f"libfabric {send} / raw-libfabric msg rate", size,
                              f"libfabric {send}", "throughput", "raw-libfabric",
                              "throughput", "rate", target))
    for size in latency_sizes:
        specs.append(("libfabric buffered / raw-libfabric latency p50", size,
                      "libfabric buffered", "latency", "raw-libfabric", "latency", "p50", None))
    # Same host: UCX in RDMA mode (shared memory) against UCX's own shared-memory reference
    # and against asyncmsg over loopback TCP.
    for send in ("zero-copy", "buffered"):
        for size in sizes:
            specs.append((f"ucx-rdma {send} / ucp_am_bw shm msg rate", size, f"ucx-rdma {send}",
                          "throughput", "ucp_am_bw shm", "throughput", "rate",
                          (">=", 0.7) if size == 1048576 and send == "zero-copy" else None))
    for size in sizes:
        specs.append(("ucx-rdma zero-copy / asyncmsg zero-copy bandwidth", size,
                      "ucx-rdma zero-copy", "throughput", "asyncmsg zero-copy", "throughput", "bw",
                      (">=", 1.1) if size == 1048576 else None))
    # Same host, equal working sets: one buffer at each end against the reference with the
    # same error handling; the default window against a memcpy of its working set.
    for size in sizes:
        if size >= SAME_HOST_W1_MIN:
            specs.append(("ucx-rdma zero-copy w1 / ucp_am_bw -e cma bandwidth", size,
                          "ucx-rdma zero-copy w1", "throughput", "ucp_am_bw -e cma",
                          "throughput", "bw", (">=", 0.8) if size == 1048576 else None))
            specs.append(("ucx-rdma zero-copy w1 / ucp_am_bw -e cma O1 bandwidth", size,
                          "ucx-rdma zero-copy w1", "throughput", "ucp_am_bw -e cma O1",
                          "throughput", "bw", None))
            specs.append(("ucx-rdma zero-copy same / ucp_am_bw -e cma bandwidth", size,
                          "ucx-rdma zero-copy same", "throughput", "ucp_am_bw -e cma",
                          "throughput", "bw", (">=", 0.9) if size == 1048576 else None))
            specs.append(("ucx-rdma zero-copy w1 / memcpy ws1 bandwidth", size,
                          "ucx-rdma zero-copy w1", "throughput", "memcpy ws1", "throughput",
                          "bw", None))
        specs.append(("ucx-rdma zero-copy / memcpy window bandwidth", size, "ucx-rdma zero-copy",
                      "throughput", "memcpy window", "throughput", "bw",
                      (">=", 0.8) if size == 1048576 else None))
        if size == BEYOND_CACHE_SIZE:
            w = beyond_cache_window(size)
            specs.append((f"ucx-rdma zero-copy w{w} / memcpy beyond cache bandwidth", size,
                          f"ucx-rdma zero-copy w{w}", "throughput", "memcpy beyond cache",
                          "throughput", "bw", None))

    # Python: the package's sender against netio3-perf's (both clients of one C++ server), and
    # the package against pyzmq's asyncio PUSH/PULL (both ends in one process each).
    for size in sizes:
        specs.append(("python zero-copy client / netio3-perf client bandwidth", size,
                      "python asyncmsg zero-copy client", "throughput",
                      "netio3-perf asyncmsg zero-copy", "throughput", "bw",
                      (">=", 0.8) if size == 1048576 else None))
    for size in sizes:
        specs.append(("python aio loopback / pyzmq asyncio push-pull msg rate", size,
                      "python asyncmsg aio loopback", "throughput", "pyzmq asyncio push-pull",
                      "throughput", "rate", (">=", 1.0) if size == 64 else None))

    def passes(ratio, target):
        op, t = target
        return ratio >= t if op == ">=" else ratio <= t

    rows = []
    for what, size, num, num_test, den, den_test, metric, target in specs:
        key = METRICS[metric]
        a, b = summaries.get((num, num_test, size)), summaries.get((den, den_test, size))
        missing = []
        for lbl, sm in ((num, a), (den, b)):
            if sm is None:
                missing.append(f"{lbl}: not run")
            elif sm.median(key) is None:
                missing.append(f"{lbl}: {sm.bad[0]['status'] if sm.bad else 'no value'}")
        if missing:
            rows.append((what, size, None, {}, target, "n/a (" + "; ".join(missing) + ")"))
            continue
        va, vb = a.median(key), b.median(key)
        ra, rb = a.by_round(key), b.by_round(key)
        per_round = {r: ra[r] / rb[r] for r in sorted(ra) if r in rb and rb[r]}
        ratio = va / vb if vb else None
        if ratio is None:
            verdict = "n/a (reference is 0)"
        elif target is None:
            verdict = "info"
        else:
            ok = passes(ratio, target)
            verdict = "pass" if ok else "FAIL"
            against = [r for r, v in per_round.items() if passes(v, target) != ok]
            if against:
                verdict += (f" ({len(against)} of {len(per_round)} rounds "
                            f"{'FAIL' if verdict == 'pass' else 'pass'})")
        left_out = [f"{lbl} round {r['round']} {r['status']}" for lbl, sm in ((num, a), (den, b))
                    for r in sm.bad]
        if left_out:
            verdict += "; left out: " + ", ".join(left_out)
        rows.append((what, size, ratio, per_round, target, verdict))
    return rows


def fan_in_tables(summaries, counts, size):
    """The fan-in section: (rows, verdict rows). rows: per backend and connection count,
    netio3's and the reference's msg/s, their rate against 1 connection, CPU per message at
    both ends, and netio3/reference; verdict rows: the target at the largest count."""
    def get(label):
        return summaries.get((label, "fan-in", size))

    def value(sm, key="msgs_per_s"):
        return sm.median(key) if sm is not None else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    def per_round(a, b, key="msgs_per_s"):
        if a is None or b is None:
            return {}
        ra, rb = a.by_round(key), b.by_round(key)
        return {r: ra[r] / rb[r] for r in sorted(ra) if r in rb and rb[r]}

    def spread(values):
        return f"{min(values):.2f}–{max(values):.2f}" if values else "-"

    def num(v, digits=2):
        return f"{v:.{digits}f}" if v is not None else "-"

    rows, verdicts = [], []
    top = max(counts)
    for backend in FAN_IN_BACKENDS:
        ref_name = FAN_IN_REFERENCE[backend]
        ours = {n: get(f"{backend} buffered x{n}") for n in counts}
        theirs = {n: get(f"{ref_name} x{n}") for n in counts}
        if all(v is None for v in ours.values()):
            continue
        for n in counts:
            a, b = ours[n], theirs[n]
            rows.append((backend, n, fmt_num(value(a)), num(ratio(value(a), value(ours[1])))
                         if 1 in ours else "-",
                         fmt_num(value(a, "cpu_ns_per_msg")),
                         fmt_num(value(a, "server_cpu_ns_per_msg")), ref_name,
                         fmt_num(value(b)), num(ratio(value(b), value(theirs.get(1))))
                         if 1 in theirs else "-",
                         fmt_num(value(b, "cpu_ns_per_msg")),
                         fmt_num(value(b, "server_cpu_ns_per_msg")),
                         num(ratio(value(a), value(b))),
                         (a.status() if a is not None else "not run") + " / " +
                         (b.status() if b is not None else "not run")))
        if 1 not in counts or top == 1:
            continue
        flat = ratio(value(ours[top]), value(ours[1]))
        flat_rounds = per_round(ours[top], ours[1])
        ref_flat = ratio(value(theirs[top]), value(theirs[1]))
        ref_rounds = per_round(theirs[top], theirs[1])
        vs = ratio(value(ours[top]), value(theirs[top]))
        vs_rounds = per_round(ours[top], theirs[top])
        if flat is None:
            verdict = "n/a (no netio3 result)"
        elif flat >= FAN_IN_FLAT:
            verdict = f"pass: {top}/1 >= {FAN_IN_FLAT}"
            below = [r for r, v in flat_rounds.items() if v < FAN_IN_FLAT]
            if below:
                verdict += f" ({len(below)} of {len(flat_rounds)} rounds below)"
        elif ref_flat is not None and ref_flat < FAN_IN_FLAT and vs is not None \
                and vs >= FAN_IN_VS_REFERENCE:
            verdict = (f"pass: the reference drops as much ({top}/1 {ref_flat:.2f}) and netio3 "
                       f">= {FAN_IN_VS_REFERENCE} x reference at {top}")
        else:
            why = []
            if ref_flat is not None and ref_flat >= FAN_IN_FLAT:
                why.append(f"the reference keeps {ref_flat:.2f}")
            if vs is not None and vs < FAN_IN_VS_REFERENCE:
                why.append(f"netio3/reference {vs:.2f} < {FAN_IN_VS_REFERENCE}")
            verdict = f"FAIL: {top}/1 < {FAN_IN_FLAT}" + (f" ({'; '.join(why)})" if why else "")
        verdicts.append((backend, num(flat), spread(list(flat_rounds.values())), ref_name,
                         num(ref_flat), spread(list(ref_rounds.values())), num(vs),
                         spread(list(vs_rounds.values())), verdict))
    return rows, verdicts


FAN_IN_HEAD = ("backend", "conns", "msg/s", "x/1", "cpu ns/msg", "server ns/msg", "reference",
               "ref msg/s", "ref x/1", "ref cpu", "ref server", "netio3/ref", "status")
FAN_IN_VERDICT_HEAD = ("backend", "N/1", "rounds", "reference", "ref N/1", "rounds",
                       "netio3/ref at N", "rounds", "verdict")


def fmt_num(v, digits=0):
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def run_rows(summaries, size):
    rows = []
    for sm in summaries.values():
        if sm.size != size:
            continue
        ok = bool(sm.ok)
        lat = sm.test == "latency"
        mbs = sm.median("bytes_per_s")
        rows.append((sm.label, sm.test, fmt_num(sm.median("msgs_per_s")) if ok else "-",
                     fmt_num(mbs / 1e6, 1) if ok and mbs else "-",
                     fmt_num(sm.median("p50_us"), 1) if ok and lat else "-",
                     fmt_num(sm.median("p99_us"), 1) if ok and lat else "-",
                     f"{len(sm.ok)}/{len(sm.records)}", sm.status()))
    return rows


RUN_HEAD = ("run", "test", "msg/s", "MB/s", "p50 RTT us", "p99 RTT us", "rounds ok", "status")
RATIO_HEAD = ("ratio", "size", "median", "rounds min–max", "target", "verdict")


def ratio_cells(rows, rounds):
    out = []
    for what, size, ratio, per_round, target, verdict in rows:
        spread = "-"
        if per_round:
            spread = f"{min(per_round.values()):.2f}–{max(per_round.values()):.2f}"
            if len(per_round) < rounds:
                spread += f" ({len(per_round)} of {rounds})"
        out.append((what, size_name(size), f"{ratio:.2f}" if ratio is not None else "-",
                    spread, f"{target[0]} {target[1]}" if target else "-", verdict))
    return out


def text_table(head, rows, wrap_last=70):
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i])
              for i in range(len(head))]
    widths[-1] = min(widths[-1], wrap_last)
    line = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 or i == len(cells) - 1 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line(head), line(["-" * w for w in widths])]
    for r in rows:
        last = r[-1]
        if len(last) > wrap_last:
            last = last[: wrap_last - 3] + "..."
        out.append(line(r[:-1] + (last,)))
    return "\n".join(out)


def md_table(head, rows):
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def machine_line():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()}, {cpu}, {os.cpu_count()} CPUs, Linux {platform.release()}"


# ---- plot --------------------------------------------------------------------------------

def plot(summaries, out, rounds):
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        return "gnuplot not installed: no plot"
    series = {}
    for sm in summaries.values():
        rate, bw = sm.median("msgs_per_s"), sm.median("bytes_per_s")
        if sm.test == "throughput" and rate and bw:
            key = (sm.label, sm.records[0].get("tool") == "netio3-perf")  # netio3's, or a reference
            series.setdefault(key, []).append((sm.size, bw / 1e6, rate))
    if not series:
        return "no throughput results: no plot"
    data_dir = out / "plot"
    data_dir.mkdir(exist_ok=True)
    files = []
    for i, ((label, ours), points) in enumerate(series.items()):
        path = data_dir / f"series{i}.dat"
        path.write_text("".join(f"{s} {mb} {mps}\n" for s, mb, mps in sorted(points)))
        files.append((label if ours else f"{label} (reference)", path, ours))
    sizes = sorted({s for points in series.values() for s, _, _ in points})
    terminals = subprocess.run([gnuplot, "-e", "set terminal"], capture_output=True,
                               text=True).stdout + subprocess.run(
        [gnuplot, "-e", "set terminal"], capture_output=True, text=True).stderr
    term = ("pngcairo size 1600,700 font ',11'" if "pngcairo" in terminals
            else "png size 1600,700")
    tics = ", ".join(f'"{size_name(s)}" {s}' for s in sizes)

    def plots(column):
        # netio3 solid, references dashed
        return ", ".join(f"'{p}' using 1:{column} with linespoints lw 2 "
                         f"dashtype {1 if ours else 2} title '{label}'"
                         for label, p, ours in files)

    title = f"netio3 backends and raw references, loopback TCP, {machine_line()}"
    if rounds > 1:
        title += f", median of {rounds} rounds"
    script = f"""
set terminal {term} noenhanced
set output '{out / "compare.png"}'
set multiplot layout 1,2 title "{title}"
set logscale x 2
set xrange [{sizes[0] / 1.6}:{sizes[-1] * 1.6}]
set logscale y 10
set xtics ({tics})
set xlabel 'message size'
set grid
set key top left font ',9'
set title 'throughput'
set ylabel 'MB/s (1 MB = 10^6 bytes)'
plot {plots(2)}
set title 'message rate'
set ylabel 'messages/s'
set key top right font ',9'
plot {plots(3)}
unset multiplot
"""
    (data_dir / "compare.gp").write_text(script)
    done = subprocess.run([gnuplot, str(data_dir / "compare.gp")], capture_output=True,
                          text=True)
    if done.returncode != 0:
        return f"gnuplot failed: {tail(done.stderr)}"
    return f"plot: {out / 'compare.png'}"


# ---- main --------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench/compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 s runs, 1 round (smoke test)")
    p.add_argument("--duration", type=float, help="seconds per run (default 5, --quick 1)")
    p.add_argument("--repeat", type=int, metavar="N",
                   help="rounds of the whole plan; the tables show the median over them "
                        "(default 3, --quick 1)")
    p.add_argument("--out", default=str(ROOT / "build/compare-results"),
                   help="output folder (default build/compare-results)")
    p.add_argument("--build-dir", default=str(ROOT / "build/release"),
                   help="where the programs are built (default build/release)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                   help="message sizes in bytes, comma separated (default 64,4096,65536,1048576)")
    p.add_argument("--busy-poll", type=int, default=200, metavar="US",
                   help="netio3-perf --busy-poll for the ucx and libfabric runs, whose "
                        "references busy-poll (default 200 microseconds; 0: sleep in epoll)")
    p.add_argument("--backends", default=",".join(FAN_IN_BACKENDS),
                   help="netio3 backends to run (default all: asyncmsg,ucx,libfabric); the "
                        "references run as --only says")
    p.add_argument("--fan-in", default=",".join(map(str, FAN_IN_CONNECTIONS)),
                   help="connection counts of the fan-in section (default 1,16,128; it needs 1)")
    p.add_argument("--fan-in-size", type=int, default=FAN_IN_SIZE, metavar="BYTES",
                   help="message size of the fan-in section (default 4096)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave the processes to the scheduler (default: every server on one "
                        "CPU, every client on another, where two CPUs are allowed)")
    p.add_argument("--only", default=",".join(GROUPS),
                   help=f"what to run, comma separated (default all: {','.join(GROUPS)})")
    args = p.parse_args(argv)
    if args.duration is None:
        args.duration = 1.0 if args.quick else 5.0
    if not args.duration > 0:
        p.error("--duration must be positive")
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        p.error("--sizes takes whole numbers")
    if not args.sizes or min(args.sizes) < 16:
        p.error("--sizes: at least one size, each at least 16 bytes")
    try:
        args.fan_in = [int(n) for n in args.fan_in.split(",") if n]
    except ValueError:
        p.error("--fan-in takes whole numbers")
    if not args.fan_in or 1 not in args.fan_in or min(args.fan_in) < 1 or max(args.fan_in) > 1024:
        p.error("--fan-in: connection counts from 1 to 1024, 1 among them")
    if args.fan_in_size < 16:
        p.error("--fan-in-size: at least 16 bytes")
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(FAN_IN_BACKENDS)
    if unknown:
        p.error(f"--backends: unknown {', '.join(sorted(unknown))}")
    args.only = [g for g in args.only.split(",") if g]
    unknown = set(args.only) - set(GROUPS)
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}")
    return args


def main(argv):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def on_signal(signum, _frame):
        stop_all_servers()
        print(f"\nbench/compare: stopped by signal {signum}", file=sys.stderr)
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    started = datetime.datetime.now()
    t0 = time.monotonic()
    client_cpu, server_cpu = pin_cpus(args.pin)
    pinning = (f"clients on CPU {client_cpu}, servers on CPU {server_cpu}"
               if client_cpu is not None else "not pinned")
    runner = Runner(args)
    try:
        runner.run()
    finally:
        stop_all_servers()
    records = runner.records
    took = time.monotonic() - t0

    with open(out / "results.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")

    rounds = args.repeat
    summaries = summarize(records)
    per_round = ", ".join(f"{s / 60:.1f}" for s in runner.round_seconds)
    how = (f"{rounds} rounds (size by size, order reversed every other round), "
           "medians over the rounds" if rounds > 1 else "1 round")
    header = (f"bench/compare {started:%Y-%m-%d %H:%M}, {args.duration:g} s per run, {how}, "
              f"loopback {HOST}, two processes per run ({pinning}); took {took / 60:.1f} min "
              f"(rounds: {per_round} min)\n{machine_line()}")
    sections = []
    md = [f"## netio3 vs. raw references\n\n{header.replace(chr(10), '  ' + chr(10))}\n"]
    rows = ratio_cells(ratio_rows(summaries, runner.sizes, runner.latency_sizes, rounds), rounds)
    spread = ("median = median of netio3's rounds / median of the reference's rounds; "
              "rounds min–max = range of the per-round ratios (round r / round r)")
    sections.append("Ratios (netio3 / reference; latency = round trip p50; sockperf and "
                    "ucx_perftest one-way latencies doubled)\n" + spread + "\n"
                    + text_table(RATIO_HEAD, rows))
    md.append("### Ratios\n\nnetio3 / reference. Latency is the round-trip p50; sockperf's and "
              "ucx_perftest's one-way latencies are doubled to round trips. " + spread[0].upper()
              + spread[1:] + ".\n\n" + md_table(RATIO_HEAD, rows) + "\n")
    md.append("### Runs\n\nMB/s = 10^6 bytes/s. Latency runs: msg/s = round trips/s. "
              f"Every figure is the median over the rounds that were ok ({rounds} in all), "
              "each column on its own.\n")
    for size in runner.sizes:
        rows = run_rows(summaries, size)
        if rows:
            sections.insert(len(sections) - 1, f"{size_name(size)}\n" + text_table(RUN_HEAD, rows))
            md.append(f"#### {size_name(size)}\n\n" + md_table(RUN_HEAD, rows) + "\n")
    if "fan-in" in args.only:
        fan_rows, fan_verdicts = fan_in_tables(summaries, args.fan_in, args.fan_in_size)
        what = (f"Fan-in: one client process with N connections to one server process, "
                f"{size_name(args.fan_in_size)} buffered sends (references: the same N); "
                f"target: msg/s at N = {max(args.fan_in)} >= {FAN_IN_FLAT} x the 1-connection "
                f"rate, or, where the reference drops as much, >= {FAN_IN_VS_REFERENCE} x the "
                "reference at N. CPU per message: client process, server process.")
        sections.append(what + "\n" + text_table(FAN_IN_HEAD, fan_rows) + "\n\n"
                        + text_table(FAN_IN_VERDICT_HEAD, fan_verdicts, wrap_last=100))
        md.append("### Fan-in\n\n" + what + "\n\n" + md_table(FAN_IN_HEAD, fan_rows) + "\n\n"
                  + md_table(FAN_IN_VERDICT_HEAD, fan_verdicts) + "\n")
    (out / "ratios.md").write_text("\n".join(md))
    plot_note = plot(summaries, out, rounds)

    print()
    print(header)
    print("MB/s = 10^6 bytes/s; latency runs: msg/s = round trips/s, p50/p99 = round trip; "
          "figures are medians over the rounds that were ok.\n")
    print("\n\n".join(sections))
    print()
    print(f"results: {out / 'results.jsonl'}; table: {out / 'ratios.md'}; {plot_note}")

    netio3 = [r for r in records if r["group"] == "netio3" or
              (r["group"] == "fan-in" and r.get("tool") == "netio3-perf")]
    lost = [r for r in netio3 if r["status"] == "lost"]
    broken = [r for r in netio3 if r["status"] == "failed"]
    if lost:
        print(f"bench/compare: {len(lost)} netio3 run(s) lost or damaged data", file=sys.stderr)
        return 1
    if broken:
        print(f"bench/compare: {len(broken)} netio3 run(s) failed", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
