"""Sessions in the asyncio layer (docs/sessions.md, asyncmsg): a connection made with
``Context(session=True)`` rides out a reset of its TCP connection - awaited sends take
longer, nothing is lost or repeated, and the interruption is visible (``conn.outages``,
the ``netio3`` logger) without a line of code to handle it."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import netio3


class Relay:
    """Forwards TCP connections from its port on 127.0.0.1 to `target`; ``reset()`` ends
    every relayed connection with a TCP reset on both sides."""

    def __init__(self, target: int):
        self.target = target
        self.port = 0
        self.accepted = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._server = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader, writer) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]

        async def pump(src, dst):
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def reset(self) -> None:
        for writer in self._writers:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.reset()
        self._server.close()
        await self._server.wait_closed()


async def test_a_session_rides_out_a_reset_and_every_message_arrives_once(caplog):
    caplog.set_level(logging.INFO, logger="netio3")
    batches, per_batch = 20, 50
    total = batches * per_batch
    received: list[int] = []
    all_in = asyncio.Event()

    async def handler(conn):
        async for message in conn:
            received.append(int.from_bytes(message[:8], "little"))
            if len(received) == total:
                all_in.set()

    async with netio3.Context("asyncmsg") as server:
        listener = await server.listen(("127.0.0.1", 0), handler)
        relay = Relay(listener.address.port)
        await relay.start()
        client = netio3.Context("asyncmsg", session=True)
        conn = await client.connect(("127.0.0.1", relay.port))
        payload = bytes(4000)
        for batch in range(batches):
            if batch == batches // 2:
                relay.reset()  # mid-stream: the next sends complete only after the resume
            sends = [conn.send((batch * per_batch + i).to_bytes(8, "little") + payload)
                     for i in range(per_batch)]
            await asyncio.wait_for(asyncio.gather(*sends), 30)
        await asyncio.wait_for(all_in.wait(), 30)
        assert received == list(range(total)), "lost, repeated or reordered"
        assert not conn.closed
        assert conn.interrupted is None
        assert len(conn.outages) >= 1 and all(o >= 0 for o in conn.outages)
        assert relay.accepted >= 2, "the session did not reconnect"
        assert "interrupted" in caplog.text and "resumed" in caplog.text
        await conn.close()
        await client.close()
        await relay.close()


def test_session_parameters_round_trip():
    session = netio3.SessionParameters(enabled=True, first_delay=0.1, max_delay=1.5, give_up=30)
    assert session.enabled and session.first_delay == 0.1 and session.max_delay == 1.5
    assert session.give_up == 30
    delivery = netio3.DeliveryParameters(session=session)
    assert delivery.session.enabled
