"""netio3's asyncio layer (layer 2) on every backend, in volume: a gibibyte of numpy arrays
and bytes intact and in order, a million sends each ending exactly once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import netio3
from helpers import BACKENDS


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
