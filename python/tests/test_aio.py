"""netio3's asyncio layer (layer 2) on every backend: the UCX-Py echo example, refusals,
streams, completions, back-pressure, peers that die, and the interpreter's own life cycle."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pathlib
import signal
import socket
import sys
import textwrap
import time

import numpy as np
import pytest

import netio3
from helpers import BACKENDS, python, read_line, stop

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_echo_server_and_client_of_the_ucx_py_documentation(backend):
    echo = load_example("echo")
    assert await echo.main(backend) == b"hello, world"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_refused_connect_raises_with_the_reason(backend):
    with socket.socket() as held:  # bound, not listening: nothing answers there
        held.bind(("127.0.0.1", 0))
        with pytest.raises(netio3.ConnectionRefused) as refused:
            await netio3.connect(held.getsockname(), backend=backend)
    assert refused.value.cause == netio3.RefusalCause.UNREACHABLE
    assert "refused" in str(refused.value).lower()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_async_iteration_over_connections_and_messages(backend):
    async with netio3.Context(backend) as context:
        listener = await context.listen(("127.0.0.1", 0))
        clients = [await netio3.Context(backend).connect(listener.address) for _ in range(2)]
        accepted = []
        async for conn in listener:
            accepted.append(conn)
            if len(accepted) == 2:
                break
        for i, client in enumerate(clients):
            for j in range(10):
                await client.send(f"{i}:{j}".encode())
            await client.close()
        for conn in accepted:
            messages = [m async for m in conn]  # ends when the peer closed
            assert len(messages) == 10
            sender = messages[0].split(b":")[0]
            assert messages == [sender + f":{j}".encode() for j in range(10)]
        assert {m for m in (c.remote for c in accepted)} == {c.remote for c in accepted}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_gibibyte_arrives_intact_and_in_order_from_numpy_arrays_and_bytes(backend):
    size = 1 << 20
    count = 1024  # 1 GiB
    listener = await netio3.listen(("127.0.0.1", 0), backend=backend)
    client = await netio3.connect(listener.address, backend=backend)
    server = await listener.accept()
    base = np.arange(size // 8, dtype=np.uint64)

    async def send():
        futures = []
        for i in range(count):
            # Even messages a numpy array, odd ones bytes: the first word says which.
            message = base + np.uint64(i) if i % 2 == 0 else (base + np.uint64(i)).tobytes()
            futures.append(await client.submit(message))
            if len(futures) >= 8:
                await futures.pop(0)
        await asyncio.gather(*futures)

    async def receive():
        for i in range(count):
            message = await server.recv()
            assert len(message) == size, i
            words = np.frombuffer(message, dtype=np.uint64)
            assert words[0] == i and words[-1] == size // 8 - 1 + i, i
            if i % 64 == 0:
                assert np.array_equal(words, base + np.uint64(i)), i

    await asyncio.gather(send(), receive())
    await client.close()
    await listener.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_every_send_of_a_million_ends_exactly_once(backend):
    total = 1_000_000
    listener = await netio3.listen(("127.0.0.1", 0), backend=backend)
    client = await netio3.connect(listener.address, backend=backend)
    server = await listener.accept()
    completed = 0
    all_completed = asyncio.Event()

    def done(future):
        nonlocal completed
        assert future.result() is None
        completed += 1
        if completed == total:
            all_completed.set()

    async def send():
        for i in range(total):
            future = await client.submit(i.to_bytes(8, "little"))
            future.add_done_callback(done)

    async def receive():
        for i in range(total):
            assert int.from_bytes(await server.recv(), "little") == i

    await asyncio.gather(send(), receive())
    await asyncio.wait_for(all_completed.wait(), 60)
    stats = client.statistics()
    assert stats.sends_accepted == total and stats.sends_completed == total
    assert stats.keys_in_flight == 0 and stats.sends_cancelled == 0
    assert completed == total
    await client.close()
    await listener.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_full_window_waits_for_the_ready_callback_not_a_retry_loop(backend):
    receiver = python(str(pathlib.Path(__file__).with_name("peer.py")), backend, "stall")
    try:
        port = int(read_line(receiver, "listening on ").rsplit(":", 1)[1])
        client = await netio3.connect(("127.0.0.1", port), backend=backend,
                                      max_message_size=65536)
        read_line(receiver, "connected")
        os.kill(receiver.pid, signal.SIGSTOP)
        payload = bytes(65536)
        futures = []

        async def fill():
            while True:
                futures.append(await client.submit(payload))

        filler = asyncio.ensure_future(fill())
        await asyncio.sleep(1.0)  # the sender is stuck in the ready wait, not spinning
        refusals = client.statistics().sends_no_resources
        assert refusals <= 3, f"{refusals} refusals while the receiver is stopped"
        assert not filler.done()
        accepted = len(futures)
        os.kill(receiver.pid, signal.SIGCONT)
        while len(futures) < accepted + 100:
            await asyncio.sleep(0.01)
        filler.cancel()
        await asyncio.gather(filler, return_exceptions=True)
        await client.close()
    finally:
        stop(receiver)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_peer_killed_mid_stream_fails_every_pending_send_once_with_its_key(backend):
    receiver = python(str(pathlib.Path(__file__).with_name("peer.py")), backend, "stall")
    try:
        port = int(read_line(receiver, "listening on ").rsplit(":", 1)[1])
        client = await netio3.connect(("127.0.0.1", port), backend=backend,
                                      max_message_size=65536)
        read_line(receiver, "connected")
        os.kill(receiver.pid, signal.SIGSTOP)  # it reads nothing: sends stay pending
        futures = []
        payload = bytes(65536)
        while True:
            try:
                futures.append(await asyncio.wait_for(client.submit(payload), 1.0))
            except asyncio.TimeoutError:
                break  # the window is full
        pending = [f for f in futures if not f.done()]
        assert pending
        receiver.kill()
        results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 60)
    finally:
        stop(receiver)
    keys = []
    for result in results:
        assert isinstance(result, netio3.ConnectionClosed), result
        keys.append(result.key)
    assert len(set(keys)) == len(keys) == len(pending)
    assert set(keys) <= set(client.cancelled_keys)
    assert client.closed


def test_ctrl_c_during_a_connect_that_never_answers_raises_within_a_second():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts into its backlog, never speaks
        script = textwrap.dedent(f"""
            import asyncio, netio3
            async def main():
                limits = netio3.NetworkLimits()
                limits.connect_timeout = 60
                print("connecting", flush=True)
                await netio3.connect({silent.getsockname()!r}, limits=limits)
            asyncio.run(main())
        """)
        child = python("-c", script)
        try:
            read_line(child, "connecting")
            start = time.monotonic()
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=10)
            elapsed = time.monotonic() - start
        finally:
            stop(child)
    assert "KeyboardInterrupt" in err, err
    assert elapsed < 1.0, elapsed


@pytest.mark.parametrize("backend", BACKENDS)
def test_exiting_with_endpoints_open_and_sends_pending_is_clean(backend):
    script = textwrap.dedent(f"""
        import asyncio, netio3
        async def main():
            listener = await netio3.listen(("127.0.0.1", 0), backend={backend!r})
            client = await netio3.connect(listener.address, backend={backend!r})
            for _ in range(100):
                await client.submit(bytes(4096))  # not awaited: pending at exit
            print("leaving", flush=True)
        asyncio.run(main())
    """)
    child = python("-X", "dev", "-W", "error", "-c", script)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out == "leaving\n"
    assert err == "", err


def test_asyncio_run_twice_in_one_process():
    # pytest-asyncio leaves an event loop set after each async test; asyncio.run would
    # replace it without closing it (a ResourceWarning later). Not netio3's: closed here.
    asyncio.get_event_loop_policy().get_event_loop().close()
    echo = load_example("echo")
    assert asyncio.run(echo.main()) == b"hello, world"
    assert asyncio.run(echo.main()) == b"hello, world"


def test_memory_stays_flat_over_a_million_messages():
    script = textwrap.dedent("""
        import asyncio, collections, gc, resource, tracemalloc, netio3
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * resource.getpagesize()
        async def main():
            listener = await netio3.listen(("127.0.0.1", 0))
            client = await netio3.connect(listener.address)
            server = await listener.accept()
            payload = bytes(64)
            async def run(n):
                async def send():
                    window = collections.deque()  # at most 256 sends in flight
                    for _ in range(n):
                        if len(window) == 256:
                            await window.popleft()
                        window.append(await client.submit(payload))
                    await asyncio.gather(*window)
                async def receive():
                    for _ in range(n):
                        await server.recv()
                await asyncio.gather(send(), receive())
            await run(100_000)  # warm-up: pools and caches reach their size
            gc.collect()
            tracemalloc.start()
            base_rss, base_traced = rss(), tracemalloc.get_traced_memory()[0]
            await run(1_000_000)
            gc.collect()
            print("growth", rss() - base_rss, tracemalloc.get_traced_memory()[0] - base_traced,
                  flush=True)
            await client.close()
            await listener.close()
        asyncio.run(main())
    """)
    child = python("-c", script)
    out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err
    rss_growth, traced_growth = (int(x) for x in out.split()[1:3])
    assert rss_growth <= 5 << 20, rss_growth
    assert traced_growth <= 5 << 20, traced_growth
