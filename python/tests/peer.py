"""A receiving peer in a process of its own, for the tests: listens, prints
"listening on IP:PORT", accepts one connection ("connected") and reads everything that
arrives until the connection ends. The tests stop it (SIGSTOP) to stall the sender, or kill
it mid-stream.

Run: python3 peer.py BACKEND stall
"""

import asyncio
import sys

import netio3


async def main(backend: str, mode: str) -> None:
    listener = await netio3.listen(("127.0.0.1", 0), backend=backend, max_message_size=65536)
    print(f"listening on {listener.address[0]}:{listener.address[1]}", flush=True)
    conn = await listener.accept()
    print("connected", flush=True)
    if mode == "stall":
        async for _ in conn:
            pass
    await listener.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
