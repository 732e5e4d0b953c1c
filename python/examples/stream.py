"""A stream of numpy arrays with the asyncio layer (docs/python.md, "Streams and
back-pressure"): the sender keeps a window of sends in flight with submit() and reuses an
array only once its send completed; the receiver checks every array.

Run: python3 stream.py [asyncmsg|libfabric|ucx]
"""

import asyncio
import collections
import sys

import numpy as np

import netio3


# [stream]
async def sender(conn, count, window=8):
    arrays = [np.empty(1 << 17, dtype=np.float64) for _ in range(window)]  # 1 MiB each
    in_flight = collections.deque()
    for i in range(count):
        if len(in_flight) == window:
            await in_flight.popleft()  # the oldest array is free again
        array = arrays[i % window]
        array.fill(i)
        # Waits only while the backend cannot take more (its ready callback ends the wait);
        # returns the future of the send's completion.
        in_flight.append(await conn.submit(array))
    await asyncio.gather(*in_flight)


async def receiver(conn, count):
    for i in range(count):
        array = np.frombuffer(await conn.recv(), dtype=np.float64)
        assert array[0] == i and array[-1] == i


async def main(backend="asyncmsg", count=256):
    async with netio3.Context(backend) as context:
        listener = await context.listen(("127.0.0.1", 0))
        client = await context.connect(listener.address)
        server = await listener.accept()
        await asyncio.gather(sender(client, count), receiver(server, count))
# [stream]


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
    print("OK")
