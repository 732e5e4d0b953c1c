"""netio3's asyncio layer (layer 2) on every backend: the UCX-Py echo example, refusals,
async iteration, back-pressure, and peers that die."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pathlib
import signal
import socket

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
