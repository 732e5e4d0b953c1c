#!/usr/bin/env python3
"""pyzmq's asyncio PUSH/PULL over loopback TCP, both ends in one process on one asyncio
loop: the Python reference of bench/compare's Python section, measured as
`python3 -m netio3.perf` measures netio3 (the same loop, the same message checks, the same
JSON keys).

The sender writes the 8-byte sequence number into one bytearray and sends it
(``await push.send(buffer)``: pyzmq copies it into a ZeroMQ message, so the buffer may be
written again at once); the receiver gets bytes (``await pull.recv()``) and checks size and
sequence number of every message. 0.2 s of warm-up are not counted.

Run: python3 bench/python/zmq_asyncio.py --size 64 --duration 3 [--json FILE]
"""

import argparse
import asyncio
import json
import resource
import sys
import time

import zmq
import zmq.asyncio


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(size: int, duration: float) -> dict:
    context = zmq.asyncio.Context()
    push = context.socket(zmq.PUSH)
    pull = context.socket(zmq.PULL)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull.connect(f"tcp://127.0.0.1:{port}")
    buffer = bytearray(size)
    state = {"stop": False, "count": 0, "bytes": 0, "intact": True, "error": ""}

    async def send() -> None:
        seq = 0
        while not state["stop"]:
            buffer[0:8] = seq.to_bytes(8, "little")
            await push.send(buffer)
            seq += 1

    async def receive() -> None:
        expected = 0
        while True:
            message = await pull.recv()
            if len(message) != size or int.from_bytes(message[:8], "little") != expected:
                state["intact"] = False
                state["error"] = f"message {expected}: wrong size or sequence number"
            expected += 1
            state["count"] += 1
            state["bytes"] += len(message)

    receiver = asyncio.ensure_future(receive())
    sender = asyncio.ensure_future(send())
    await asyncio.sleep(0.2)
    count0, bytes0 = state["count"], state["bytes"]
    start, cpu0 = time.perf_counter(), cpu_seconds()
    await asyncio.sleep(duration)
    seconds = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    messages, nbytes = state["count"] - count0, state["bytes"] - bytes0
    state["stop"] = True
    await sender
    receiver.cancel()
    await asyncio.gather(receiver, return_exceptions=True)
    push.close(linger=0)
    pull.close(linger=0)
    context.term()
    return {
        "tool": "pyzmq-asyncio", "backend": "zmq", "mode": "tcp", "send": "copy",
        "test": "throughput", "size": size, "connections": 1, "threads": 0, "window": 0,
        "loopback": True, "duration_s": seconds, "messages": messages, "bytes": nbytes,
        "msgs_per_s": messages / seconds, "bytes_per_s": nbytes / seconds,
        "gbit_per_s": nbytes * 8 / seconds / 1e9,
        "cpu_ns_per_msg": cpu / messages * 1e9 if messages else None,
        "server_cpu_ns_per_msg": None, "p50_us": None, "p99_us": None, "p999_us": None,
        "intact": state["intact"], "error": state["error"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.size < 8:
        parser.error("--size: at least 8 (the sequence number)")
    result = asyncio.run(measure(args.size, args.duration))
    print(f"pyzmq asyncio push-pull {args.size} B: {result['msgs_per_s']:.0f} msg/s, "
          f"{result['bytes_per_s'] / 1e6:.1f} MB/s, cpu {result['cpu_ns_per_msg']:.0f} ns/msg, "
          f"{'intact' if result['intact'] else 'NOT INTACT: ' + result['error']}")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if result["intact"] else 1


if __name__ == "__main__":
    sys.exit(main())
