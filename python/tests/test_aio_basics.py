"""netio3's asyncio layer (layer 2) on every backend: refusals, async iteration,
back-pressure, and peers that die."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time

import pytest

import netio3
from helpers import BACKENDS, PEER, python, read_line, stop


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
async def test_acknowledged_sends_return_once_the_peer_has_the_message(backend):
    async with netio3.Context(backend) as server:
        listener = await server.listen(("127.0.0.1", 0))
        async with netio3.Context(backend, acknowledged=True) as context:
            client = await context.connect(listener.address)
            conn = await listener.accept()
            for j in range(10):
                await client.send(f"m{j}".encode())  # returns on the peer's acknowledgement
            # Closed right after the last send: the close waits for nothing more, and
            # everything arrived.
            await client.close()
            assert [m async for m in conn] == [f"m{j}".encode() for j in range(10)]


@contextlib.asynccontextmanager
async def a_stopped_receiver(backend):
    """A connection to a receiver in another process (peer.py) that is then stopped
    (SIGSTOP), so that it reads nothing; yields (receiver process, connection)."""
    receiver = python(PEER, backend, "stall")
    try:
        port = int(read_line(receiver, "listening on ").rsplit(":", 1)[1])
        client = await netio3.connect(("127.0.0.1", port), backend=backend,
                                      max_message_size=65536)
        read_line(receiver, "connected")
        os.kill(receiver.pid, signal.SIGSTOP)
        yield receiver, client
    finally:
        stop(receiver)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_full_window_waits_for_the_ready_callback_not_a_retry_loop(backend):
    async with a_stopped_receiver(backend) as (receiver, client):
        payload = bytes(65536)
        futures = []

        async def fill():
            while True:
                futures.append(await client.submit(payload))

        filler = asyncio.ensure_future(fill())
        # Not a synchronisation: a second in which the sender must stay in the ready wait
        # (a retry loop would count a refusal per try).
        await asyncio.sleep(1.0)
        refusals = client.statistics().sends_no_resources
        assert refusals <= 3, f"{refusals} refusals while the receiver is stopped"
        assert not filler.done()
        accepted = len(futures)
        os.kill(receiver.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while len(futures) < accepted + 100 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(futures) >= accepted + 100, "the sender did not resume"
        filler.cancel()
        await asyncio.gather(filler, return_exceptions=True)
        await client.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_peer_killed_mid_stream_fails_every_pending_send_once_with_its_key(backend):
    async with a_stopped_receiver(backend) as (receiver, client):
        futures = []  # the receiver reads nothing: sends stay pending
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
    keys = []
    for result in results:
        assert isinstance(result, netio3.ConnectionClosed), result
        keys.append(result.key)
    assert len(set(keys)) == len(keys) == len(pending)
    assert set(keys) <= set(client.cancelled_keys)
    assert client.closed
    # Why: the receiver was killed (a reset, or no goodbye came): a lost peer, not a close.
    assert results[0].reason is not None
    assert results[0].cause == netio3.CloseCause.PEER_LOST
    assert results[0].reason.message in str(results[0])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_connection_closed_says_why_on_both_sides(backend):
    async with netio3.Context(backend) as context:
        listener = await context.listen(("127.0.0.1", 0))
        client = await netio3.Context(backend).connect(listener.address)
        accepted = await listener.accept()
        await client.send(b"last words")
        await client.close()
        assert await accepted.recv() == b"last words"  # delivered before the end
        with pytest.raises(netio3.ConnectionClosed) as peer_side:
            await accepted.recv()
        assert peer_side.value.cause == netio3.CloseCause.PEER_CLOSED
        assert peer_side.value.reason.message == "peer closed the connection"
        assert "PEER_CLOSED" in str(peer_side.value)
        with pytest.raises(netio3.ConnectionClosed) as local_side:
            await client.recv()
        assert local_side.value.cause == netio3.CloseCause.LOCAL
        assert client.close_reason.cause == netio3.CloseCause.LOCAL


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_context_admits_the_holders_of_its_key_that_its_accept_function_takes(backend):
    key = "partition-of-the-aio-test"
    asked = []

    def accept(peer):
        asked.append(peer.identity)
        return peer.key_proven and peer.identity.startswith("ros-")

    async with netio3.Context(backend, partition_key=key, accept=accept) as server, \
            netio3.Context(backend, partition_key=key, identity="ros-1") as good, \
            netio3.Context(backend, partition_key=key, identity="laptop") as laptop, \
            netio3.Context(backend, partition_key="another-partition-key") as stranger:
        listener = await server.listen(("127.0.0.1", 0))
        conn = await good.connect(listener.address)
        await conn.send(b"admitted")
        accepted = await listener.accept()
        assert await accepted.recv() == b"admitted"
        with pytest.raises(netio3.ConnectionRefused) as refused:
            await laptop.connect(listener.address)
        assert refused.value.cause == netio3.RefusalCause.NOT_ADMITTED
        assert "accept hook" in str(refused.value)
        with pytest.raises(netio3.ConnectionRefused) as refused:
            await stranger.connect(listener.address)
        assert refused.value.cause == netio3.RefusalCause.NOT_ADMITTED
        assert "failed to prove the partition key" in str(refused.value)
    assert asked == ["ros-1", "laptop"], "the function is asked only about holders of the key"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_max_message_size_bounds_every_backend_and_a_larger_send_is_send_failed(backend):
    async with netio3.Context(backend, max_message_size=4096) as context:
        listener = await context.listen(("127.0.0.1", 0))
        client = await netio3.Context(backend, max_message_size=4096).connect(listener.address)
        accepted = await listener.accept()
        await client.send(bytes(4096))  # the largest allowed
        assert len(await accepted.recv()) == 4096
        with pytest.raises(netio3.SendFailed) as failed:
            await client.send(bytes(4097))
        assert "exceeds max_message_size (4096 bytes)" in str(failed.value)
        with pytest.raises(TypeError):  # one buffer per message, on every backend
            await client.send([b"ab", b"cd"])
        await client.send(b"still open")
        assert await accepted.recv() == b"still open"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_send_the_backend_refuses_says_why(backend):
    async with netio3.Context(backend, max_message_size=4096) as context:
        listener = await context.listen(("127.0.0.1", 0))
        client = await netio3.Context(backend, max_message_size=65536).connect(listener.address)
        await listener.accept()
        with pytest.raises(netio3.SendFailed) as failed:
            await client.send(bytes(10000))  # fine here, too large for the peer
        assert failed.value.cause == netio3.SendFailureCause.TOO_LARGE
        assert "10000 bytes" in failed.value.reason.message
        assert failed.value.reason.message in str(failed.value)
