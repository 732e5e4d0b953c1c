"""The echo server and client of UCX-Py's documentation ("Send/Recv Internals": a listener
with a callback per connection, an endpoint that sends "hello, world" and receives it back),
written with netio3's asyncio layer. docs/python.md shows it; python/tests run it on every
backend.

Run: python3 echo.py [asyncmsg|libfabric|ucx]
"""

import asyncio
import sys

import netio3


# [echo]
async def echo_server(conn):
    message = await conn.recv()
    await conn.send(message)


async def main(backend="asyncmsg"):
    listener = await netio3.listen(("127.0.0.1", 0), echo_server, backend=backend)
    client = await netio3.connect(listener.address, backend=backend)
    msg = bytearray(b"hello, world")
    await client.send(msg)
    echo_msg = await client.recv()
    await client.close()
    await listener.close()
    return echo_msg
# [echo]


if __name__ == "__main__":
    print(asyncio.run(main(*sys.argv[1:])))
