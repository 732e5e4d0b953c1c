"""netio3-perf's measurements from Python: ``python3 -m netio3.perf``.

Loopback in one process, both ends on one asyncio loop (as ``netio3-perf --loopback``, whose
two ends share one netio3 loop): a sender and a receiver with the asyncio layer, or with the
callback layer (``--api callbacks``: the C++ API one to one, the loop run by run()).

    python3 -m netio3.perf --backend asyncmsg --size 64,1m --duration 3
    python3 -m netio3.perf --test latency --size 64
    python3 -m netio3.perf --client 127.0.0.1:PORT --size 1m     # to netio3-perf --server

With --client the Python program is a netio3-perf client in a process of its own, sending to
a `netio3-perf --server` (C++) in netio3-perf's protocol (tools/netio3-perf/protocol.hpp,
throughput only): the same server measures a C++ client and a Python one, so the two rates
compare the senders alone. Zero-copy sends come from a ring of --window slots of one numpy
array, written in place (the first and last payload byte, as netio3-perf's light check
reads them), each slot reused once its send completed.

Prints one line per run (messages/s, MB/s, Gbit/s, CPU per message; round-trip percentiles
for latency) and appends a JSON record per run to --json FILE, with the keys of
netio3-perf's records ("tool": "netio3.perf").

How the asyncio layer sends: ``await conn.submit(payload)`` per message, at most --window
messages in flight (each ``submit`` returns the completion future, awaited when the window is
full). asyncmsg sends from the payload object itself (zero-copy, --send zero-copy, the
default there), UCX copies it once (--send copy), libfabric through a send buffer
(--send buffered). Every message is checked at the receiver (size and sequence number).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import resource
import struct
import sys
import time
from typing import Optional

import numpy as np

import netio3


def _size(text: str) -> int:
    text = text.strip().lower()
    factor = 1
    if text.endswith("k"):
        factor, text = 1 << 10, text[:-1]
    elif text.endswith("m"):
        factor, text = 1 << 20, text[:-1]
    value = int(text) * factor
    if value < 8:
        raise argparse.ArgumentTypeError("a message carries an 8-byte sequence number: >= 8")
    return value


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Result:
    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0
        self.seconds = 0.0
        self.cpu = 0.0
        self.intact = True
        self.error = ""
        self.latencies: list[float] = []

    def percentile(self, p: float) -> Optional[float]:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1e6


async def _throughput_aio(args, size: int) -> Result:
    context = netio3.Context(args.backend, args.mode, max_message_size=size,
                             num_buffers=max(16, args.window))
    listener = await context.listen(("127.0.0.1", 0))
    client = await context.connect(listener.address)
    server = await listener.accept()
    zero_copy = {"zero-copy": True, "copy": False}.get(args.send)
    payloads = [bytearray(size) for _ in range(args.window)]
    result = Result()
    stop = False

    async def send() -> None:
        window: collections.deque = collections.deque()
        seq = 0
        while not stop:
            payload = payloads[seq % len(payloads)]
            if len(window) == len(payloads):
                await window.popleft()  # its payload may be written again
            payload[0:8] = seq.to_bytes(8, "little")
            window.append(await client.submit(payload, zero_copy=zero_copy))
            seq += 1
        await asyncio.gather(*window)

    async def receive() -> None:
        expected = 0
        async for message in server:
            if len(message) != size or int.from_bytes(message[:8], "little") != expected:
                result.intact = False
                result.error = f"message {expected}: wrong size or sequence number"
            expected += 1
            result.messages = expected
            result.bytes += len(message)

    receiver = asyncio.ensure_future(receive())
    sender = asyncio.ensure_future(send())
    await asyncio.sleep(0.2)  # warm-up, not counted
    start_messages, start_bytes = result.messages, result.bytes
    start, start_cpu = time.perf_counter(), _cpu_seconds()
    await asyncio.sleep(args.duration)
    result.seconds = time.perf_counter() - start
    result.cpu = _cpu_seconds() - start_cpu
    result.messages -= start_messages
    result.bytes -= start_bytes
    stop = True
    await sender
    await client.close()
    await receiver
    await context.close()
    return result


async def _latency_aio(args, size: int) -> Result:
    async def echo(conn) -> None:
        async for message in conn:
            await conn.send(message)

    context = netio3.Context(args.backend, args.mode, max_message_size=size)
    listener = await context.listen(("127.0.0.1", 0), echo)
    client = await context.connect(listener.address)
    payload = bytearray(size)
    result = Result()
    deadline = None
    warm = 1000
    start = start_cpu = 0.0
    while True:
        t0 = time.perf_counter()
        await client.send(payload)
        reply = await client.recv()
        t1 = time.perf_counter()
        if len(reply) != size:
            result.intact = False
            result.error = "a reply of the wrong size"
        if warm > 0:
            warm -= 1
            if warm == 0:
                start, start_cpu = time.perf_counter(), _cpu_seconds()
                deadline = start + args.duration
            continue
        result.latencies.append(t1 - t0)
        if t1 >= deadline:
            break
    result.seconds = time.perf_counter() - start
    result.cpu = _cpu_seconds() - start_cpu
    result.messages = len(result.latencies)
    result.bytes = result.messages * size
    await client.close()
    await context.close()
    return result


# netio3-perf's protocol (tools/netio3-perf/protocol.hpp): a 16-byte header, host byte order.
_MAGIC = 0x4E33
_HELLO, _START, _DATA, _END, _REPORT = 1, 4, 5, 6, 7
_HEADER = struct.Struct("<HHIQ")
_START_BODY = struct.Struct("<IIII")  # test (1: throughput), size, verify (1: light), reserved
_REPORT_BODY = struct.Struct("<QQQQ")  # bytes, errors, cpu_ns, elapsed_ns
_PERIOD = 251  # netio3-perf's payload pattern: byte k of message seq is (seq + k) % 251


async def _throughput_client(args, size: int) -> Result:
    host, _, port = args.client.rpartition(":")
    payload_size = size - _HEADER.size
    context = netio3.Context(args.backend, args.mode, max_message_size=size)
    conn = await context.connect((host, int(port)))
    hello = await conn.recv()
    magic, kind, token, _ = _HEADER.unpack_from(hello)
    if magic != _MAGIC or kind != _HELLO:
        raise RuntimeError("not a netio3-perf server (no HELLO)")
    await conn.send(_HEADER.pack(_MAGIC, _START, token, 0) +
                    _START_BODY.pack(1, size, 1, 0))
    zero_copy = {"zero-copy": True, "copy": False}.get(args.send)
    region = np.zeros((args.window, max(payload_size, 1)), dtype=np.uint8)
    window: collections.deque = collections.deque()
    result = Result()
    seq = 0
    start, start_cpu = time.perf_counter(), _cpu_seconds()
    deadline = start + args.duration
    while time.perf_counter() < deadline:
        if len(window) == args.window:
            await window.popleft()  # the oldest slot is free again
        slot = region[seq % args.window, :payload_size]
        if payload_size:
            slot[0] = seq % _PERIOD
            slot[-1] = (seq + payload_size - 1) % _PERIOD
        window.append(await conn.submit(slot, _HEADER.pack(_MAGIC, _DATA, token, seq),
                                        zero_copy=zero_copy))
        seq += 1
    await asyncio.gather(*window)
    result.seconds = time.perf_counter() - start
    result.cpu = _cpu_seconds() - start_cpu
    await conn.send(_HEADER.pack(_MAGIC, _END, token, seq))
    report = await conn.recv()
    _, kind, _, received = _HEADER.unpack_from(report)
    nbytes, errors, _, _ = _REPORT_BODY.unpack_from(report, _HEADER.size)
    if kind != _REPORT or received != seq or errors:
        result.intact = False
        result.error = f"the server received {received} of {seq}, {errors} damaged"
    result.messages = seq
    result.bytes = seq * size
    await conn.close()
    await context.close()
    return result


def _throughput_callbacks(args, size: int) -> Result:
    """The callback layer: the loop runs on this thread (run()); the sender refills from
    on_ready_to_send_cb and completions, as netio3-perf with --threads 0."""
    loop = netio3.EpollEventLoop()
    result = Result()
    state = {"seq": 0, "expected": 0, "stop": False, "remote": None}
    payloads = [bytearray(size) for _ in range(args.window)]
    free = collections.deque(range(args.window))
    backend_type = args.backend

    def send_more() -> None:
        remote = state["remote"]
        while free and not state["stop"]:
            slot = free[0]
            payload = payloads[slot]
            seq = state["seq"]
            payload[0:8] = seq.to_bytes(8, "little")
            if backend_type == "libfabric":
                buffer = client.get_buffer(remote)
                if buffer is None:
                    return
                buffer.write(payload)
                status = client.send_buffer(remote, buffer)
                key = buffer.id
            elif backend_type == "ucx":
                key = slot
                status = client.send_data_copy(remote, payload, None, key)
            else:
                key = slot
                status = client.send_data(remote, payload, None, key)
            if status != netio3.NetioStatus.OK:
                return
            free.popleft()
            state["seq"] = seq + 1
            if backend_type == "libfabric":
                free.append(slot)  # copied into the buffer: the slot is free at once

    def on_completed(remote, key) -> None:
        if backend_type != "libfabric":
            free.append(key)
        send_more()

    def on_data(data) -> None:
        if len(data) != size or int.from_bytes(data[:8], "little") != state["expected"]:
            result.intact = False
            result.error = f"message {state['expected']}: wrong size or sequence number"
        state["expected"] += 1
        result.messages += 1
        result.bytes += len(data)

    def on_established(remote, capabilities) -> None:
        if remote == listening:
            state["remote"] = remote
            send_more()

    recv = netio3.RecvParameters(buf_size=size, num_buf=64)
    server = netio3.create(args.backend, netio3.NetworkConfig(
        mode=netio3.NetworkMode.TCP if args.mode == "tcp" else netio3.NetworkMode.RDMA,
        on_data_cb=on_data, receive=netio3.Receive.MEMORYVIEW), loop)
    client = netio3.create(args.backend, netio3.NetworkConfig(
        mode=netio3.NetworkMode.TCP if args.mode == "tcp" else netio3.NetworkMode.RDMA,
        on_connection_established_cb=on_established, on_send_completed_cb=on_completed,
        on_ready_to_send_cb=lambda remote: send_more()), loop)
    listening = server.open_listen_endpoint(("127.0.0.1", 0), netio3.ConnectionParameters(recv))
    params = netio3.ConnectionParameters()
    if backend_type == "libfabric":
        params = netio3.ConnectionParameters(
            send_buffered_params=netio3.SendBufferedParameters(size, args.window))
    client.open_active_endpoint(listening, params)
    marks = {}

    def begin() -> None:
        marks["start"] = (time.perf_counter(), _cpu_seconds(), result.messages, result.bytes)
        timer.start_once(args.duration)

    def end() -> None:
        t, cpu, m, b = marks["start"]
        result.seconds = time.perf_counter() - t
        result.cpu = _cpu_seconds() - cpu
        result.messages -= m
        result.bytes -= b
        state["stop"] = True
        loop.stop()

    warm = loop.create_timer(begin)
    timer = loop.create_timer(end)
    warm.start_once(0.2)
    loop.run()
    client.close()
    server.close()
    return result


def _report(args, size: int, result: Result, out) -> None:
    where = "client" if args.client else "loopback"
    what = (f"{args.backend} {args.mode} {args.send} {args.test} {size} B python-{args.api} "
            f"{where} window {args.window}")
    per_msg = result.cpu / result.messages * 1e9 if result.messages else float("nan")
    rate = result.messages / result.seconds if result.seconds else 0.0
    byte_rate = result.bytes / result.seconds if result.seconds else 0.0
    state = "intact" if result.intact else "NOT INTACT: " + result.error
    if args.test == "latency":
        line = (f"{what}: {rate:.0f} round trips/s, round trip p50 {result.percentile(0.5):.2f} "
                f"us, p99 {result.percentile(0.99):.2f} us, cpu {per_msg:.0f} ns/msg, {state}")
    else:
        ends = "this client" if args.client else "both ends"
        line = (f"{what}: {rate:.0f} msg/s, {byte_rate / 1e6:.1f} MB/s, "
                f"{byte_rate * 8 / 1e9:.3f} Gbit/s, cpu {per_msg:.0f} ns/msg ({ends}), {state}")
    print(line, file=out, flush=True)
    if args.json:
        record = {
            "tool": "netio3.perf", "api": args.api, "backend": args.backend, "mode": args.mode,
            "send": args.send, "test": args.test, "size": size, "connections": 1, "threads": 0,
            "window": args.window, "loopback": not args.client, "duration_s": result.seconds,
            "messages": result.messages, "bytes": result.bytes, "msgs_per_s": rate,
            "bytes_per_s": byte_rate, "gbit_per_s": byte_rate * 8 / 1e9,
            "cpu_ns_per_msg": per_msg, "server_cpu_ns_per_msg": None, "client": args.client,
            "p50_us": result.percentile(0.5), "p99_us": result.percentile(0.99),
            "p999_us": result.percentile(0.999), "intact": result.intact, "error": result.error,
        }
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m netio3.perf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="asyncmsg", choices=["asyncmsg", "libfabric", "ucx"])
    parser.add_argument("--mode", default="tcp", choices=["tcp", "rdma"])
    parser.add_argument("--test", default="throughput", choices=["throughput", "latency"])
    parser.add_argument("--send", default=None, choices=["zero-copy", "copy", "buffered"],
                        help="default: zero-copy on asyncmsg, copy on ucx, buffered on libfabric")
    parser.add_argument("--api", default="aio", choices=["aio", "callbacks"])
    parser.add_argument("--size", default="4k",
                        type=lambda s: [_size(x) for x in s.split(",")])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--window", type=int, default=None,
                        help="messages in flight (default: netio3-perf's, 2 MiB / size "
                             "within 8..1024)")
    parser.add_argument("--client", default="",
                        help="IP:PORT of a netio3-perf --server: be its client (throughput)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.send is None:
        args.send = {"asyncmsg": "zero-copy", "ucx": "copy", "libfabric": "buffered"}[args.backend]
    if args.client and (args.api != "aio" or args.test != "throughput"):
        parser.error("--client: the asyncio layer's throughput only")
    status = 0
    window = args.window
    for size in args.size:
        args.window = window or max(8, min(1024, (2 << 20) // size))
        if args.client:
            result = asyncio.run(_throughput_client(args, size))
        elif args.api == "callbacks":
            if args.test == "latency":
                parser.error("--api callbacks measures throughput only")
            result = _throughput_callbacks(args, size)
        elif args.test == "latency":
            result = asyncio.run(_latency_aio(args, size))
        else:
            result = asyncio.run(_throughput_aio(args, size))
        _report(args, size, result, sys.stdout)
        if not result.intact:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
