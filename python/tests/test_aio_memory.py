"""netio3's asyncio layer (layer 2) on every backend: resident memory and Python's traced
memory stay flat (at most 5 MB of growth) over a million messages, after a warm-up."""

from __future__ import annotations

import textwrap

import pytest

from helpers import BACKENDS, python


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_stays_flat_over_a_million_messages(backend):
    script = textwrap.dedent(f"""
        import asyncio, collections, gc, resource, tracemalloc, netio3
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * resource.getpagesize()
        async def main():
            listener = await netio3.listen(("127.0.0.1", 0), backend={backend!r})
            client = await netio3.connect(listener.address, backend={backend!r})
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
