"""netio3's asyncio layer (docs/python.md, layer 2).

The netio3 event loop runs inside the asyncio loop: its descriptor is read by the asyncio
loop (``add_reader``), so every netio3 callback runs on the asyncio thread, in a round of
``EpollEventLoop.run_once`` that holds the GIL; no thread of netio3 ever waits for the GIL.

    listener = await netio3.listen(("127.0.0.1", 0), handler)   # handler(conn) per connection
    conn = await netio3.connect(listener.address)                # refusal raises
    await conn.send(b"hello")            # resolves when the send completed
    message = await conn.recv()          # or: async for message in conn
    await conn.close()

Sends that the backend cannot take now ("NO_RESOURCES") wait for its ready-to-send
callback, never in a retry loop. A send whose connection ends first fails with
ConnectionClosed carrying its key.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import logging
import select
import time
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

from . import _netio3 as _n

__all__ = [
    "Connection",
    "ConnectionClosed",
    "ConnectionRefused",
    "Context",
    "Listener",
    "SendFailed",
    "connect",
    "listen",
]

Address = Any  # an EndPointAddress or an (IP, port) pair

_log = logging.getLogger("netio3")
Buffer = Any  # a C-contiguous buffer-protocol object: bytes, bytearray, memoryview, numpy


class ConnectionRefused(_n.NetioException):
    """``connect`` could not set up the connection: ``reason.cause`` (a RefusalCause) says
    what kind of failure, ``reason.message`` what happened."""

    def __init__(self, remote: Address, reason: _n.RefusalReason):
        super().__init__(f"connection to {_text(remote)} refused ({reason.cause.name}): "
                         f"{reason.message}")
        self.remote = remote
        self.reason = reason
        self.cause = reason.cause


class ConnectionClosed(_n.NetioException):
    """The connection ended: raised by ``recv`` once every message that arrived was read, and
    by a send that it cancelled (``key``: that send's key; ``cancelled_keys``: every key the
    close cancelled, in send order). ``reason`` is the backend's ``CloseReason`` (None where
    the connection ended before it was set up) and ``cause`` its ``CloseCause``: LOCAL,
    PEER_CLOSED, PEER_LOST, TIMED_OUT or PROTOCOL_ERROR."""

    def __init__(self, remote: Address, key: Optional[int] = None,
                 cancelled_keys: tuple[int, ...] = (),
                 reason: Optional[_n.CloseReason] = None):
        what = f"; send {key} was cancelled" if key is not None else ""
        why = f" ({reason.cause.name}: {reason.message})" if reason is not None else ""
        super().__init__(f"connection with {_text(remote)} closed{why}{what}")
        self.remote = remote
        self.key = key
        self.cancelled_keys = cancelled_keys
        self.reason = reason
        self.cause = reason.cause if reason is not None else None


class SendFailed(_n.NetioException):
    """The backend refused a send for good (FAILED: too large for the peer, header over 16
    bytes, a payload outside the zero-copy region, a connection that is closing, ...).
    ``reason`` is the backend's ``SendFailure`` (``cause``: a ``SendFailureCause``, also in
    ``cause``; ``message``, also in the text); None where the check was this layer's."""

    def __init__(self, message: str, reason: Optional[_n.SendFailure] = None):
        super().__init__(message)
        self.reason = reason
        self.cause = reason.cause if reason is not None else None


def _text(address: Address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _address(address: Address) -> _n.EndPointAddress:
    if isinstance(address, _n.EndPointAddress):
        return address
    host, port = address
    return _n.EndPointAddress(host, port)


def _backend_type(backend: Union[str, _n.BackendType]) -> _n.BackendType:
    if isinstance(backend, _n.BackendType):
        return backend
    try:
        return {"asyncmsg": _n.BackendType.ASYNCMSG, "libfabric": _n.BackendType.LIBFABRIC,
                "ucx": _n.BackendType.UCX}[backend.lower()]
    except KeyError:
        raise _n.InvalidConfiguration(
            f"unknown backend {backend!r} (asyncmsg, libfabric, ucx)") from None


def _network_mode(mode: Union[str, _n.NetworkMode]) -> _n.NetworkMode:
    if isinstance(mode, _n.NetworkMode):
        return mode
    try:
        return {"tcp": _n.NetworkMode.TCP, "rdma": _n.NetworkMode.RDMA}[mode.lower()]
    except KeyError:
        raise _n.InvalidConfiguration(f"unknown network mode {mode!r} (tcp, rdma)") from None


def _fail_quietly(future: asyncio.Future, error: BaseException) -> None:
    """Fails a future that nobody may await (a send submitted and left, a waiter): the end
    of its connection is reported by recv() and `closed` as well, so asyncio need not log it
    as "never retrieved" (reading exception() once marks it retrieved)."""
    if not future.done():
        future.set_exception(error)
        future.exception()


# ---- the netio3 loop inside the asyncio loop -------------------------------------------------


class _Driver:
    """One netio3 EpollEventLoop attached to the thread of one asyncio loop."""

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop = aloop
        self.evloop = _n.EpollEventLoop()
        self.evloop.attach()
        self.fd = self.evloop.fileno()
        self._soon: Optional[asyncio.Handle] = None
        self.defaults: dict[tuple, Context] = {}
        self.backends: "weakref.WeakSet[_Backend]" = weakref.WeakSet()
        aloop.add_reader(self.fd, self._round)

    def _round(self) -> None:
        self._soon = None
        if not self.evloop.run_once():
            self._soon = self.aloop.call_soon(self._round)

    def release(self) -> None:
        """Closes what runs on this loop and releases the thread: when the asyncio loop
        closed, and at exit. The connections still open are closed first, and the netio3 loop
        runs (for a second at most) until their transports wound them down - UCX flushes with
        its peers, which may be other backends of this loop - with no callback reaching
        futures of an asyncio loop that is gone; then the backends go."""
        backends = [b for b in list(self.backends) if b.backend is not None]
        for b in backends:
            b.exiting = True
        if self.evloop.in_loop_thread():
            for b in backends:
                for remote in list(b.connections):
                    try:
                        b.backend.close_active_endpoint(remote)
                    except _n.NetioException:
                        pass
            deadline = time.monotonic() + 1.0
            while any(b.connections for b in backends) and time.monotonic() < deadline:
                if self.evloop.run_once():
                    select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        for b in backends:
            b.close()
        self.defaults.clear()
        if not self.aloop.is_closed():
            try:
                self.aloop.remove_reader(self.fd)
            except (RuntimeError, ValueError):
                pass
        if self.evloop.in_loop_thread():
            self.evloop.detach()


# One driver per asyncio loop. A loop that closed (asyncio.run returned) has its driver
# released the next time a driver is looked up, and at exit.
_drivers: dict[asyncio.AbstractEventLoop, _Driver] = {}


def _driver() -> _Driver:
    aloop = asyncio.get_running_loop()
    driver = _drivers.get(aloop)
    if driver is None:
        for old in [loop for loop in _drivers if loop.is_closed()]:
            _drivers.pop(old).release()
        driver = _drivers[aloop] = _Driver(aloop)
    return driver


@atexit.register
def _release_all() -> None:
    while _drivers:
        _drivers.popitem()[1].release()


# ---- one netio3 backend and the Python objects of its connections ---------------------------


class _Backend:
    """A NetworkBackend on the driver's loop, its connections by remote address, and how
    this layer sends on it: zero-copy (asyncmsg: from the object itself), copy (UCX), or
    through a send buffer (libfabric, which cannot copy)."""

    def __init__(self, driver: _Driver, options: "_Options", listener: Optional[Listener] = None):
        self.driver = driver
        self.options = options
        self.type = options.backend
        self.listener = listener
        self.connections: dict[Any, Connection] = {}
        self.connecting: dict[Any, asyncio.Future] = {}
        self.closing_waiters: list[asyncio.Future] = []
        self.exiting = False  # at exit: no callback reaches the futures of a closed loop
        self.backend: Optional[_n.NetworkBackend] = None
        self._keys = itertools.count(1)
        self.send_mode = {_n.BackendType.ASYNCMSG: "zero-copy", _n.BackendType.UCX: "copy",
                          _n.BackendType.LIBFABRIC: "buffered"}[self.type]
        ref = weakref.ref(self)

        # The callbacks hold the backend weakly: the C++ side keeps them alive, and a strong
        # reference would make the pair a cycle the garbage collector cannot see.
        def on_data(remote, data):
            s = ref()
            if s is not None and not s.exiting:
                c = s.connections.get(remote)
                if c is not None:
                    c._deliver(data)

        def on_established(remote, capabilities):
            s = ref()
            if s is not None and not s.exiting:
                s._established(remote, capabilities)

        def on_closed(remote, keys, reason):
            s = ref()
            if s is not None:
                s._closed(remote, keys, reason)  # also while exiting: release() waits for it

        def on_refused(remote, reason):
            s = ref()
            if s is not None and not s.exiting:
                s._refused(remote, reason)

        def to_connection(method):
            # A callback that calls `method` of the connection with `remote`, if there is one.
            def callback(remote, *args):
                s = ref()
                if s is not None and not s.exiting:
                    c = s.connections.get(remote)
                    if c is not None:
                        method(c, *args)
            return callback

        on_completed = to_connection(Connection._completed)
        on_ready = to_connection(Connection._ready)
        on_interrupted = to_connection(Connection._interrupted)
        on_resumed = to_connection(Connection._resumed)

        self._config = _n.NetworkConfig(
            mode=options.mode,
            on_data_from_cb=on_data,
            on_connection_established_cb=on_established,
            on_connection_closed_reason_cb=on_closed,
            on_connection_refused_reason_cb=on_refused,
            on_send_completed_cb=on_completed,
            on_ready_to_send_cb=on_ready,
            limits=options.limits,
            receive=options.receive,
            partition_key=options.partition_key,
            identity=options.identity,
            on_accept_cb=options.accept,
            on_connection_interrupted_cb=on_interrupted,
            on_connection_resumed_cb=on_resumed,
        )
        self._finalizer: Optional[weakref.finalize] = None

    async def start(self) -> None:
        """Creates the netio3 backend, on a thread of the default executor: starting a
        transport may take longer than an asyncio step should (the GIL is released
        meanwhile)."""
        self.backend = await self.driver.aloop.run_in_executor(
            None, _n.create, self.type, self._config, self.driver.evloop)
        # Closed when the last connection and listener using it are gone, or with the driver.
        self._finalizer = weakref.finalize(self, _n.NetworkBackend.close, self.backend)
        self._finalizer.atexit = False  # _release_all closes it in order at exit
        self.driver.backends.add(self)

    def parameters(self, region: Optional[Buffer] = None) -> _n.ConnectionParameters:
        o = self.options
        size = o.max_message_size + _n.MAX_HEADER_SIZE
        if self.listener is not None:
            # One receive pool for all of the listener's connections.
            recv = _n.RecvParameters(buf_size=size, num_buf=4 * o.num_buffers,
                                     use_shared_receive_buffers=True)
        else:
            recv = _n.RecvParameters(buf_size=size, num_buf=o.num_buffers)
        delivery = _n.DeliveryParameters(
            acknowledged=o.acknowledged or o.session,
            session=_n.SessionParameters(enabled=o.session and self.listener is None))
        if region is not None:
            return _n.ConnectionParameters(
                recv_params=recv, send_zero_copy_params=_n.SendZeroCopyParameters(region),
                delivery=delivery)
        buffered = _n.SendBufferedParameters()
        if self.send_mode == "buffered":
            buffered = _n.SendBufferedParameters(
                buf_size=o.max_message_size + _n.MAX_HEADER_SIZE, num_buf=o.num_buffers)
        return _n.ConnectionParameters(recv_params=recv, send_buffered_params=buffered,
                                       delivery=delivery)

    def next_key(self) -> int:
        return next(self._keys)

    # -- callbacks (asyncio thread, inside a round) --

    def _established(self, remote, capabilities) -> None:
        connection = Connection(self, remote, capabilities)
        self.connections[remote] = connection
        future = self.connecting.pop(remote, None)
        if future is not None:
            if not future.done():
                future.set_result(connection)
        elif self.listener is not None:
            self.listener._accepted(connection)

    def _closed(self, remote, keys, reason) -> None:
        connection = self.connections.pop(remote, None)
        if self.exiting:
            return
        future = self.connecting.pop(remote, None)
        if future is not None and not future.done():  # closed during set-up by the application
            future.cancel()
        if connection is not None:
            connection._ended(tuple(keys), reason)
        if not self.connections:
            for waiter in self.closing_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self.closing_waiters.clear()

    def _refused(self, remote, reason) -> None:
        future = self.connecting.pop(remote, None)
        if future is not None and not future.done():
            future.set_exception(ConnectionRefused(remote, reason))

    async def connect(self, address: Address, region: Optional[Buffer]) -> Connection:
        remote = _address(address)
        future = self.driver.aloop.create_future()
        self.connecting[remote] = future
        try:
            # On the executor: the first endpoint starts the transport (possibly slow).
            await self.driver.aloop.run_in_executor(
                None, self.backend.open_active_endpoint, remote, self.parameters(region))
        except BaseException:
            self.connecting.pop(remote, None)
            raise
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled (Ctrl-C, a timeout): the endpoint being set up goes too.
            self.connecting.pop(remote, None)
            try:
                self.backend.close_active_endpoint(remote)
            except _n.UnknownActiveEndpoint:
                pass
            raise

    async def wait_connections_closed(self) -> None:
        if self.connections:
            waiter = self.driver.aloop.create_future()
            self.closing_waiters.append(waiter)
            await waiter

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


class _Options:
    def __init__(self, backend, mode, max_message_size, num_buffers, limits,
                 partition_key="", identity="", accept=None, acknowledged=False,
                 session=False):
        self.backend = _backend_type(backend)
        self.acknowledged = acknowledged
        self.session = session
        self.partition_key = partition_key
        self.identity = identity
        self.accept = accept
        self.mode = _network_mode(mode)
        if max_message_size <= 0 or num_buffers <= 0:
            raise _n.InvalidConfiguration("max_message_size and num_buffers must be > 0")
        self.max_message_size = max_message_size
        self.num_buffers = num_buffers
        self.receive = _n.Receive.BYTES
        self.limits = limits if limits is not None else _n.NetworkLimits()
        # The largest message, on every backend: what is sent and what is accepted from a
        # peer (asyncmsg and UCX otherwise took up to the C++ default of 64 MiB).
        self.limits.max_message_size = max_message_size + _n.MAX_HEADER_SIZE
        self.limits.max_receive_memory = max(self.limits.max_receive_memory,
                                             self.limits.max_message_size)


# ---- connections -------------------------------------------------------------------------


class Connection:
    """One established connection, either side. ``remote`` is its EndPointAddress (for an
    accepted one, the peer's source address); ``capabilities`` what it can do locally."""

    def __init__(self, owner: _Backend, remote, capabilities: _n.EndpointCapabilities):
        self._owner = owner
        self.remote = remote
        self.capabilities = capabilities
        self._aloop = owner.driver.aloop
        self._messages: collections.deque = collections.deque()
        self._recv_waiter: Optional[asyncio.Future] = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ready_waiters: list[asyncio.Future] = []
        self._spare: Optional[_n.NetworkBuffer] = None  # a refused, filled send buffer
        self._closed = False
        self._close_waiter: Optional[asyncio.Future] = None
        self.cancelled_keys: tuple[int, ...] = ()
        #: Why it ended (a CloseReason), once it did.
        self.close_reason: Optional[_n.CloseReason] = None
        #: Sessions: why the connection is interrupted now (None while it is not), and the
        #: outages it rode out, in seconds.
        self.interrupted: Optional[str] = None
        self.outages: list[float] = []

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<netio3.Connection {_text(self.remote)} {self._owner.type.name.lower()} {state}>"

    @property
    def closed(self) -> bool:
        """True once the connection ended (messages already received may still be read)."""
        return self._closed

    # -- sending --

    def _try_send(self, data: Buffer, header: Optional[Buffer],
                  zero_copy: Optional[bool]) -> Optional[asyncio.Future]:
        if self._closed:
            raise ConnectionClosed(self.remote, reason=self.close_reason)
        owner = self._owner
        size = memoryview(data).nbytes
        if size > owner.options.max_message_size:
            raise SendFailed(f"send to {_text(self.remote)}: a message of {size} bytes exceeds "
                             f"max_message_size ({owner.options.max_message_size} bytes)")
        backend = owner.backend
        mode = owner.send_mode if zero_copy is None else ("zero-copy" if zero_copy else "copy")
        if mode == "buffered":
            buffer = self._spare
            self._spare = None
            if buffer is None:
                buffer = backend.get_buffer(self.remote)
                if buffer is None:
                    return None
                if header is not None:
                    if memoryview(header).nbytes > _n.MAX_HEADER_SIZE:
                        raise ValueError(f"header_data of {memoryview(header).nbytes} bytes: "
                                         f"at most {_n.MAX_HEADER_SIZE}")
                    buffer.write(header)
                buffer.write(data)
            key = buffer.id
            status = backend.send_buffer(self.remote, buffer)
            if status == _n.NetioStatus.NO_RESOURCES:
                self._spare = buffer  # still ours: sent on the next try
        else:
            key = owner.next_key()
            if mode == "zero-copy":
                status = backend.send_data(self.remote, data, header, key)
            else:
                status = backend.send_data_copy(self.remote, data, header, key)
        if status == _n.NetioStatus.OK:
            future = self._aloop.create_future()
            self._pending[key] = future
            return future
        if status == _n.NetioStatus.NO_RESOURCES:
            return None
        failure = _n.last_send_failure()
        raise SendFailed(f"send to {_text(self.remote)} failed ({failure.cause.name}): "
                         f"{failure.message}", failure)

    async def submit(self, data: Buffer, header: Optional[Buffer] = None, *,
                     zero_copy: Optional[bool] = None) -> asyncio.Future:
        """Hands the message to netio3, waiting only while the backend cannot take it now
        (its ready-to-send callback ends the wait), and returns a future that resolves when
        the send completed (or fails with ConnectionClosed). For senders that keep many
        messages in flight."""
        while True:
            future = self._try_send(data, header, zero_copy)
            if future is not None:
                return future
            await self._wait_ready()

    async def send(self, data: Buffer, header: Optional[Buffer] = None, *,
                   zero_copy: Optional[bool] = None) -> None:
        """Sends one message and returns when the send completed (its buffer is free again).

        ``data`` is any C-contiguous buffer-protocol object; up to 16 bytes of ``header``
        travel in front of it (the receiver gets both as one message). How it leaves depends
        on the backend: asyncmsg sends from the object itself (it is held, and a bytearray
        cannot be resized, until the send completed), UCX copies it once, libfabric copies it
        into a send buffer. ``zero_copy=True`` sends from the object on UCX too (it must lie
        in the region given to ``connect(zero_copy_region=...)``)."""
        await (await self.submit(data, header, zero_copy=zero_copy))

    async def _wait_ready(self) -> None:
        waiter = self._aloop.create_future()
        self._ready_waiters.append(waiter)
        await waiter

    # -- receiving --

    async def recv(self) -> Union[bytes, memoryview]:
        """The next message; ConnectionClosed once the connection ended and every message
        that arrived was read."""
        if self._messages:
            return self._messages.popleft()
        if self._closed:
            raise ConnectionClosed(self.remote, cancelled_keys=self.cancelled_keys,
                                   reason=self.close_reason)
        if self._recv_waiter is not None:
            raise RuntimeError("another coroutine is already waiting in recv()")
        waiter = self._recv_waiter = self._aloop.create_future()
        try:
            return await waiter
        finally:
            self._recv_waiter = None

    def __aiter__(self) -> AsyncIterator:
        return self

    async def __anext__(self):
        try:
            return await self.recv()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    # -- closing --

    async def close(self) -> None:
        """Closes the connection and waits until it ended; sends that had not completed fail
        with ConnectionClosed. Closing a closed connection does nothing."""
        if self._closed:
            return
        if self._close_waiter is None:
            self._close_waiter = self._aloop.create_future()
            try:
                self._owner.backend.close_active_endpoint(self.remote)
            except _n.UnknownActiveEndpoint:
                pass  # ended meanwhile: its closed callback is on its way
        await asyncio.shield(self._close_waiter)

    async def __aenter__(self) -> "Connection":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def statistics(self) -> _n.ConnectionStatistics:
        """This connection's counters (ConnectionStatistics)."""
        return self._owner.backend.statistics(self.remote)

    # -- from the backend's callbacks --

    def _deliver(self, data) -> None:
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            self._recv_waiter = None
            waiter.set_result(data)
        else:
            self._messages.append(data)

    def _completed(self, key: int) -> None:
        future = self._pending.pop(key, None)
        if future is not None and not future.done():
            future.set_result(None)

    def _interrupted(self, reason: str) -> None:
        # Nothing to do for the application: sends wait, the session resumes by itself.
        self.interrupted = reason
        _log.warning("connection with %s interrupted (%s); resuming it", _text(self.remote),
                     reason)

    def _resumed(self, outage: float) -> None:
        self.interrupted = None
        self.outages.append(outage)
        _log.info("connection with %s resumed after %.3f s", _text(self.remote), outage)

    def _ready(self) -> None:
        waiters, self._ready_waiters = self._ready_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _ended(self, keys: tuple[int, ...], reason: Optional[_n.CloseReason] = None) -> None:
        self._closed = True
        self.cancelled_keys = keys
        self.close_reason = reason
        self._spare = None
        pending, self._pending = self._pending, {}
        for key in keys:
            future = pending.pop(key, None)
            if future is not None:
                _fail_quietly(future, ConnectionClosed(self.remote, key, keys, reason))
        for future in pending.values():  # not reported: cannot happen, but never hang
            _fail_quietly(future, ConnectionClosed(self.remote, None, keys, reason))
        closed = ConnectionClosed(self.remote, cancelled_keys=keys, reason=reason)
        for waiter in self._ready_waiters:
            _fail_quietly(waiter, closed)
        self._ready_waiters.clear()
        if self._recv_waiter is not None and not self._recv_waiter.done():
            self._recv_waiter.set_exception(closed)
        if self._close_waiter is None:
            self._close_waiter = self._aloop.create_future()
        if not self._close_waiter.done():
            self._close_waiter.set_result(None)


# ---- listeners ---------------------------------------------------------------------------


class Listener:
    """A listen endpoint with a backend of its own. New connections go to ``handler(conn)``
    (a coroutine function: one task per connection, cancelled when the listener closes) or,
    without a handler, to ``accept()`` / ``async for conn in listener``."""

    def __init__(self, driver: _Driver, options: _Options, handler):
        self._driver = driver
        self._handler = handler
        self._owner = _Backend(driver, options, self)
        self._queue: collections.deque = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.address = None

    async def _open(self, address: Address) -> None:
        await self._owner.start()
        self.address = await self._driver.aloop.run_in_executor(
            None, self._owner.backend.open_listen_endpoint, _address(address),
            self._owner.parameters())

    def __repr__(self) -> str:
        return f"<netio3.Listener {_text(self.address)} {self._owner.type.name.lower()}>"

    @property
    def closed(self) -> bool:
        return self._closed

    def _accepted(self, connection: Connection) -> None:
        if self._handler is not None:
            task = self._driver.aloop.create_task(self._handler(connection))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(connection)
            self._waiter = None
        else:
            self._queue.append(connection)

    async def accept(self) -> Connection:
        """The next new connection (without a handler)."""
        if self._queue:
            return self._queue.popleft()
        if self._closed:
            raise ConnectionClosed(self.address)
        waiter = self._waiter = self._driver.aloop.create_future()
        return await waiter

    def __aiter__(self) -> AsyncIterator:
        return self

    async def __anext__(self) -> Connection:
        try:
            return await self.accept()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    async def close(self) -> None:
        """Stops listening, closes every connection it accepted (waiting for their end) and
        cancels the handlers' tasks."""
        if self._closed:
            return
        self._closed = True
        try:
            self._owner.backend.close_listen_endpoint(self.address)
        except _n.UnknownListenEndpoint:
            pass
        await self._owner.wait_connections_closed()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._waiter is not None:
            _fail_quietly(self._waiter, ConnectionClosed(self.address))
        self._owner.close()

    async def __aenter__(self) -> "Listener":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# ---- contexts and the module-level functions ------------------------------------------------


class Context:
    """A transport and its options on the running asyncio loop: ``connect`` shares one
    backend of it; each ``listen`` gets a backend of its own.

    backend: "asyncmsg", "libfabric" or "ucx" (or a BackendType); mode: "tcp" or "rdma";
    max_message_size: the largest message sent or received, header included up to 16 bytes
    more (libfabric's receive and send buffers are this large); num_buffers: receive (and
    libfabric send) buffers per connection, four times as many shared by a listener's
    connections; limits: NetworkLimits. Messages arrive as bytes; a zero-copy view of
    received data is the callback layer's (NetworkConfig(receive=Receive.MEMORYVIEW)).

    Admission (docs/admission.md): partition_key, a secret of at least 16 bytes that both
    sides of every connection prove they hold; identity, the name this side presents with
    its proof; accept(peer), a plain function (not a coroutine: it decides before the
    connection exists) asked about every peer a listener of this context gets - a PeerInfo
    (remote, listener, identity, key_proven); it returns True, False, AcceptDecision.accept()
    or AcceptDecision.refuse("why"), and an exception refuses with its text. A refused
    connect raises ConnectionRefused with cause NOT_ADMITTED and the server's reason.

    acknowledged=True (docs/semantics.md, "Acknowledged sends"): this side's sends are
    acknowledged by the peer, so an awaited ``send`` returns once the peer's application
    was handed the message, not once it left this process; closing a connection first waits
    (up to 10 s) for what was sent before to be acknowledged.

    session=True (docs/sessions.md, asyncmsg): connections this context makes are
    acknowledged and ride out a cut - a reset, a link down longer than peer_timeout - without
    a close: they reconnect by themselves and send again exactly what the peer had not
    delivered, so every message arrives once and in order and awaited sends simply take
    longer. ``conn.interrupted`` says why while it is cut, ``conn.outages`` lists the
    outages ridden out; both are logged on the ``netio3`` logger. A listener needs nothing
    (its clients ask).
    """

    def __init__(self, backend: Union[str, _n.BackendType] = "asyncmsg",
                 mode: Union[str, _n.NetworkMode] = "tcp", *,
                 max_message_size: int = 1 << 20, num_buffers: int = 16,
                 limits: Optional[_n.NetworkLimits] = None, partition_key: str = "",
                 identity: str = "",
                 accept: Optional[Callable[[_n.PeerInfo],
                                           Union[bool, _n.AcceptDecision]]] = None,
                 acknowledged: bool = False, session: bool = False):
        self._options = _Options(backend, mode, max_message_size, num_buffers, limits,
                                 partition_key, identity, accept, acknowledged, session)
        self._driver: Optional[_Driver] = None
        self._client: Optional[_Backend] = None
        self._client_started: Optional[asyncio.Future] = None
        self._listeners: list[Listener] = []

    def _ensure(self) -> _Driver:
        driver = _driver()
        if self._driver is not driver:  # another asyncio loop (asyncio.run again)
            self._driver = driver
            self._client = None
            self._client_started = None
        return driver

    async def connect(self, address: Address, *,
                      zero_copy_region: Optional[Buffer] = None) -> Connection:
        """Connects; raises ConnectionRefused (with the reason) if it cannot be set up."""
        driver = self._ensure()
        if self._client is None:
            self._client = _Backend(driver, self._options)
            self._client_started = asyncio.ensure_future(self._client.start())
        await asyncio.shield(self._client_started)
        return await self._client.connect(address, zero_copy_region)

    async def listen(self, address: Address = ("0.0.0.0", 0),
                     handler: Optional[Callable[[Connection], Awaitable[None]]] = None
                     ) -> Listener:
        """Listens on ``address`` (port 0: the OS chooses; ``listener.address`` tells)."""
        driver = self._ensure()
        listener = Listener(driver, self._options, handler)
        await listener._open(address)
        self._listeners.append(listener)
        return listener

    async def close(self) -> None:
        """Closes its listeners and connections, waiting for their end."""
        for listener in self._listeners:
            await listener.close()
        self._listeners.clear()
        if self._client is not None:
            for connection in list(self._client.connections.values()):
                await connection.close()
            self._client.close()
            self._client = None
            self._client_started = None

    async def __aenter__(self) -> "Context":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _default(backend, mode, options: dict) -> Context:
    driver = _driver()
    key = (_backend_type(backend), _network_mode(mode), tuple(sorted(options.items())))
    context = driver.defaults.get(key)
    if context is None:
        context = driver.defaults[key] = Context(backend, mode, **options)
    return context


async def connect(address: Address, *, backend: Union[str, _n.BackendType] = "asyncmsg",
                  mode: Union[str, _n.NetworkMode] = "tcp",
                  zero_copy_region: Optional[Buffer] = None, **options) -> Connection:
    """Connects to a netio3 listener; raises ConnectionRefused (with the reason) if the
    connection cannot be set up. Options as for Context."""
    return await _default(backend, mode, options).connect(address,
                                                          zero_copy_region=zero_copy_region)


async def listen(address: Address = ("0.0.0.0", 0),
                 handler: Optional[Callable[[Connection], Awaitable[None]]] = None, *,
                 backend: Union[str, _n.BackendType] = "asyncmsg",
                 mode: Union[str, _n.NetworkMode] = "tcp", **options) -> Listener:
    """Listens on ``address`` (port 0: the OS chooses; ``listener.address`` tells). Each new
    connection goes to ``handler(conn)`` (a coroutine function, one task per connection) or,
    without one, to ``listener.accept()`` / ``async for conn in listener``. Options as for
    Context."""
    return await _default(backend, mode, options).listen(address, handler)
