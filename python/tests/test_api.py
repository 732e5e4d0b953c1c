"""The C++ API for Python, one to one (layer 1), on every backend: the loop driven from the
test's thread (attach / run_once), or run() on a thread of its own."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import weakref

import numpy as np
import pytest

import netio3
from helpers import BACKENDS, Recorder, drive

RECV = netio3.RecvParameters(buf_size=1 << 16, num_buf=32)


@pytest.fixture
def loop():
    loop = netio3.EpollEventLoop()
    loop.attach()
    yield loop
    loop.detach()


def pair(loop, backend, client_params, server_recorder=None, client_recorder=None):
    """A server and a client backend on `loop`, connected; returns (server, client, rs, rc,
    listen address)."""
    rs = server_recorder or Recorder()
    rc = client_recorder or Recorder()
    server = netio3.create(backend, rs.config(), loop)
    client = netio3.create(backend, rc.config(), loop)
    listening = server.open_listen_endpoint(("127.0.0.1", 0), netio3.ConnectionParameters(RECV))
    client.open_active_endpoint(listening, client_params)
    assert drive(loop, lambda: rc.established and rs.established), (rc.refused, rs.refused)
    return server, client, rs, rc, listening


def test_every_cpp_exception_is_a_python_class_of_that_name_under_netio_exception():
    names = ["InvalidEndpointAddress", "ListenEndpointAlreadyExists", "FailedOpenListenEndpoint",
             "InvalidConnectionParameters", "ActiveEndpointAlreadyExists",
             "FailedOpenActiveEndpoint", "UnknownActiveEndpoint", "UnknownListenEndpoint",
             "NoBuffersAllocated", "NotSupported", "FailedCloseActiveEndpoint",
             "FailedCloseListenEndpoint", "BufferOverflow", "InvalidConfiguration"]
    for name in names:
        cls = getattr(netio3, name)
        assert issubclass(cls, netio3.NetioException), name
    assert issubclass(netio3.NetioException, RuntimeError)


def test_a_failed_system_call_raises_oserror_with_its_errno():
    """No file descriptor left: the loop's epoll_create1 fails (std::system_error in C++)."""
    import errno
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        with pytest.raises(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        with pytest.raises(OSError) as raised:
            netio3.EpollEventLoop()
        assert raised.value.errno == errno.EMFILE
        assert not isinstance(raised.value, netio3.NetioException)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    netio3.EpollEventLoop()  # and works again


@pytest.mark.parametrize("backend", BACKENDS)
def test_exceptions_carry_the_reason(loop, backend):
    b = netio3.create(backend, netio3.NetworkConfig(), loop)
    with pytest.raises(netio3.InvalidEndpointAddress, match="host names are not resolved"):
        b.open_listen_endpoint(("localhost", 0))
    listening = b.open_listen_endpoint(("127.0.0.1", 0))
    with pytest.raises(netio3.ListenEndpointAlreadyExists):
        b.open_listen_endpoint(listening)
    with pytest.raises(netio3.UnknownActiveEndpoint):
        b.get_buffer(("127.0.0.1", 1))
    with pytest.raises(TypeError):
        b.open_active_endpoint("127.0.0.1:5000")
    with pytest.raises(netio3.InvalidConfiguration):
        netio3.create("carrier-pigeon", netio3.NetworkConfig(), loop)
    with pytest.raises(netio3.InvalidConfiguration):
        netio3.create(backend, netio3.NetworkConfig(on_data_cb=print, on_data_from_cb=print),
                      loop)
    b.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refusal_says_why(loop, backend):
    r = Recorder()
    b = netio3.create(backend, r.config(), loop)
    gone = b.open_listen_endpoint(("127.0.0.1", 0))
    b.close_listen_endpoint(gone)
    b.open_active_endpoint(gone, netio3.ConnectionParameters(
        send_buffered_params=netio3.SendBufferedParameters(4096, 4)))
    assert drive(loop, lambda: r.refused)
    remote, reason = r.refused[0]
    assert remote == gone and isinstance(remote, netio3.EndPointAddress)
    assert reason.cause == netio3.RefusalCause.UNREACHABLE
    assert "refused" in reason.message.lower()
    b.close()


def test_a_partition_key_admits_its_holders_only(loop):
    key = "partition-of-the-python-test"
    rs, good, wrong = Recorder(), Recorder(), Recorder()
    server = netio3.create("asyncmsg", rs.config(partition_key=key), loop)
    listening = server.open_listen_endpoint(("127.0.0.1", 0), netio3.ConnectionParameters(RECV))
    params = netio3.ConnectionParameters(
        send_buffered_params=netio3.SendBufferedParameters(4096, 4))
    client = netio3.create("asyncmsg", good.config(partition_key=key, identity="ros-1"), loop)
    stranger = netio3.create("asyncmsg", wrong.config(partition_key="another-partition-key"),
                             loop)
    client.open_active_endpoint(listening, params)
    stranger.open_active_endpoint(listening, params)
    assert drive(loop, lambda: good.established and wrong.refused), (good.refused, wrong.refused)
    _, reason = wrong.refused[0]
    assert reason.cause == netio3.RefusalCause.NOT_ADMITTED
    assert "failed to prove the partition key" in reason.message
    assert client.send_data_copy(listening, b"admitted", b"", 1) == netio3.NetioStatus.OK
    assert drive(loop, lambda: rs.data)
    assert [data for _, data in rs.data] == [b"admitted"]
    assert len(rs.established) == 1
    with pytest.raises(netio3.InvalidConfiguration):
        netio3.create("asyncmsg", netio3.NetworkConfig(partition_key="short"), loop)
    for b in (stranger, client, server):
        b.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_accept_hook_decides_about_each_peer_with_its_proven_identity(loop, backend):
    key = "partition-of-the-python-test"
    asked = []

    def hook(peer):
        asked.append((peer.remote, peer.listener, peer.identity, peer.key_proven))
        assert f"identity={peer.identity!r}" in repr(peer)
        if peer.identity == "ros-1":
            return netio3.AcceptDecision.accept()
        if peer.identity == "ros-2":
            return False
        if peer.identity == "ros-3":
            raise RuntimeError("the run-control database is down")
        if peer.identity == "ros-4":
            return "yes"  # neither an AcceptDecision nor a bool
        return netio3.AcceptDecision.refuse(f"{peer.identity} is not in this partition")

    rs = Recorder()
    server = netio3.create(backend, rs.config(partition_key=key, on_accept_cb=hook), loop)
    listening = server.open_listen_endpoint(("127.0.0.1", 0), netio3.ConnectionParameters(RECV))
    params = netio3.ConnectionParameters(
        send_buffered_params=netio3.SendBufferedParameters(4096, 4))
    expected = {
        "ros-1": None,
        "ros-2": "accept hook",
        "ros-3": "the accept hook failed: RuntimeError: the run-control database is down",
        "ros-4": "the accept hook returned a str, neither an AcceptDecision nor a bool",
        "ros-99": "ros-99 is not in this partition",
    }
    clients = []
    for identity, refusal in expected.items():
        r = Recorder()
        client = netio3.create(backend, r.config(partition_key=key, identity=identity), loop)
        clients.append(client)
        client.open_active_endpoint(listening, params)
        assert drive(loop, lambda: r.established or r.refused), identity
        if refusal is None:
            assert r.established and not r.refused, r.refused
        else:
            assert not r.established
            _, reason = r.refused[0]
            assert reason.cause == netio3.RefusalCause.NOT_ADMITTED
            assert refusal in reason.message, reason.message
    assert [identity for _, _, identity, _ in asked] == list(expected)
    for remote, listener, _, proven in asked:
        assert isinstance(remote, netio3.EndPointAddress) and remote.address == "127.0.0.1"
        assert listener == listening
        assert proven
    assert drive(loop, lambda: len(rs.established) == 1)
    for b in (*clients, server):
        b.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_copy_from_bytes_bytearray_memoryview_and_numpy(loop, backend):
    region = np.zeros(1 << 16, dtype=np.uint8)  # UCX and libfabric send from inside it only
    # asyncmsg without a region sends from anywhere (with one, only from inside it).
    params = netio3.ConnectionParameters() if backend == "asyncmsg" else \
        netio3.ConnectionParameters(send_zero_copy_params=netio3.SendZeroCopyParameters(region))
    server, client, rs, rc, listening = pair(loop, backend, params)
    payloads = [region[0:100], region[100:300].reshape(10, 20), memoryview(region)[300:301]]
    if backend == "asyncmsg":  # sends from anywhere
        payloads += [b"bytes", bytearray(b"bytearray"), np.arange(7, dtype=np.int64)]
    region[:] = np.arange(region.size) % 251
    for key, payload in enumerate(payloads):
        assert client.send_data(listening, payload, b"hd", key) == netio3.NetioStatus.OK
    assert drive(loop, lambda: len(rs.data) == len(payloads) and len(rc.completed) == len(payloads))
    for (_, data), payload in zip(rs.data, payloads):
        assert data == b"hd" + memoryview(payload).tobytes()
    assert sorted(key for _, key in rc.completed) == list(range(len(payloads)))
    client.close()
    server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_acknowledged_sends_complete_once_the_peer_was_handed_them(loop, backend):
    params = netio3.ConnectionParameters(
        recv_params=netio3.RecvParameters(4096, 4),
        delivery=netio3.DeliveryParameters(acknowledged=True, replay_window=1 << 20))
    assert params.delivery.acknowledged and params.delivery.replay_window == 1 << 20
    region = np.zeros(1 << 12, dtype=np.uint8)
    if backend != "asyncmsg":
        params.send_zero_copy_params = netio3.SendZeroCopyParameters(region)
    seen_at_completion = []
    server, client, rs, rc, listening = pair(loop, backend, params)
    rc_completed = rc.completed

    class Watch(list):
        def append(self, item):  # the server's count when each completion is recorded
            seen_at_completion.append(len(rs.data))
            super().append(item)

    rc.completed = Watch(rc_completed)
    for key in range(5):
        assert client.send_data(listening, region[key * 10:key * 10 + 10], b"h", key) == \
            netio3.NetioStatus.OK
    assert drive(loop, lambda: len(rc.completed) == 5)
    assert [key for _, key in rc.completed] == list(range(5))
    assert all(seen >= i + 1 for i, seen in enumerate(seen_at_completion)), seen_at_completion
    client.close()
    server.close()


def test_a_bytearray_cannot_be_resized_while_its_send_is_in_flight(loop):
    server, client, rs, rc, listening = pair(loop, "asyncmsg", netio3.ConnectionParameters())
    payload = bytearray(b"x" * 1000)
    assert client.send_data(listening, payload, None, 7) == netio3.NetioStatus.OK
    with pytest.raises(BufferError):
        payload.extend(b"more")  # held: the transport reads it in place
    assert drive(loop, lambda: rc.completed)
    payload.extend(b"more")  # released with the completion
    client.close()
    server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_contiguous_array_and_a_long_header_raise_before_anything_is_sent(loop, backend):
    region = np.zeros(4096, dtype=np.uint8)
    params = netio3.ConnectionParameters(
        send_zero_copy_params=netio3.SendZeroCopyParameters(region))
    server, client, rs, rc, listening = pair(loop, backend, params)
    with pytest.raises(BufferError):
        client.send_data(listening, region[::2], None, 1)
    with pytest.raises(ValueError, match="at most 16"):
        client.send_data(listening, region[:8], b"x" * 17, 2)
    with pytest.raises(TypeError):
        client.send_data(listening, "text is not a buffer", None, 3)
    stats = client.statistics(listening)
    assert stats.sends_accepted == 0 and stats.sends_failed == 0
    assert client.send_data(listening, region[:8], None, 4) == netio3.NetioStatus.OK
    with pytest.raises(ValueError, match="in flight"):
        client.send_data(listening, region[8:16], None, 4)
    assert drive(loop, lambda: rs.data and rc.completed)
    assert len(rs.data) == 1
    client.close()
    server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffered_sends_through_a_writable_view(loop, backend):
    params = netio3.ConnectionParameters(
        send_buffered_params=netio3.SendBufferedParameters(buf_size=4096, num_buf=4))
    server, client, rs, rc, listening = pair(loop, backend, params)
    buffer = client.get_buffer(listening)
    assert buffer.capacity == 4096 and buffer.size == 0
    view = np.frombuffer(buffer.view(), dtype=np.uint8)
    view[:100] = np.arange(100, dtype=np.uint8)
    buffer.size = 100
    buffer.write(b"!")
    key = buffer.id
    assert client.send_buffer(listening, buffer) == netio3.NetioStatus.OK
    with pytest.raises(ValueError, match="no longer yours"):
        buffer.write(b"late")
    assert drive(loop, lambda: rs.data and rc.completed)
    assert rs.data[0][1] == bytes(range(100)) + b"!"
    assert rc.completed[0][1] == key
    # Every buffer can be lent; then get_buffer says None.
    lent = [client.get_buffer(listening) for _ in range(4)]
    assert all(b is not None for b in lent) and client.get_buffer(listening) is None
    client.close()
    with pytest.raises(ValueError, match="backend was closed"):
        lent[0].write(b"x")
    server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_received_memoryview_is_released_when_the_callback_returns(loop, backend):
    kept = []
    rs = Recorder()
    config = rs.config(on_data_from_cb=None, on_data_cb=lambda view: kept.append(
        (view, view.tobytes())))
    config.receive = netio3.Receive.MEMORYVIEW
    server = netio3.create(backend, config, loop)
    rc = Recorder()
    client = netio3.create(backend, rc.config(), loop)
    listening = server.open_listen_endpoint(("127.0.0.1", 0), netio3.ConnectionParameters(RECV))
    client.open_active_endpoint(listening, netio3.ConnectionParameters(
        send_buffered_params=netio3.SendBufferedParameters(4096, 4)))
    assert drive(loop, lambda: rc.established)
    buffer = client.get_buffer(listening)
    buffer.write(b"payload")
    assert client.send_buffer(listening, buffer) == netio3.NetioStatus.OK
    assert drive(loop, lambda: kept)
    view, copy = kept[0]
    assert copy == b"payload"
    with pytest.raises(ValueError, match="released"):
        view.tobytes()
    client.close()
    server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_the_connection_and_the_listener_from_inside_a_data_callback(loop, backend):
    state = {}

    def on_data(remote, data):
        state["server"].close_active_endpoint(remote)
        state["server"].close_listen_endpoint(state["listening"])
        state["closed_in_callback"] = True

    rs = Recorder()
    server = state["server"] = netio3.create(backend, rs.config(on_data_from_cb=on_data), loop)
    rc = Recorder()
    client = netio3.create(backend, rc.config(), loop)
    listening = state["listening"] = server.open_listen_endpoint(
        ("127.0.0.1", 0), netio3.ConnectionParameters(RECV))
    client.open_active_endpoint(listening, netio3.ConnectionParameters(
        send_buffered_params=netio3.SendBufferedParameters(4096, 4)))
    assert drive(loop, lambda: rc.established)
    buffer = client.get_buffer(listening)
    buffer.write(b"close now")
    assert client.send_buffer(listening, buffer) == netio3.NetioStatus.OK
    assert drive(loop, lambda: rs.closed and rc.closed)
    assert state["closed_in_callback"]
    with pytest.raises(netio3.UnknownListenEndpoint):
        server.close_listen_endpoint(listening)
    client.close()
    server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropping_the_last_reference_with_sends_in_flight_releases_everything(loop, backend):
    region = np.zeros(1 << 20, dtype=np.uint8)
    alive = weakref.ref(region)
    params = netio3.ConnectionParameters(
        send_zero_copy_params=netio3.SendZeroCopyParameters(region))
    server, client, rs, rc, listening = pair(loop, backend, params)
    del params
    before = sys.getrefcount(region)
    sent = 0
    for key in range(64):
        if client.send_data(listening, region[key * 16384:(key + 1) * 16384], None, key) != \
                netio3.NetioStatus.OK:
            break
        sent += 1
    assert sent > 0
    assert sys.getrefcount(region) > before, "the sends hold the region's slices"
    del client  # sends in flight: dropped, not reported, nothing kept
    gc.collect()
    assert sys.getrefcount(region) == before - 1, "the connection's region was released too"
    del region
    gc.collect()
    assert alive() is None
    server.close()


def test_an_exception_in_a_callback_goes_to_unraisablehook_and_the_backend_carries_on(loop):
    seen = []
    old = sys.unraisablehook
    sys.unraisablehook = lambda info: seen.append(info)
    try:
        def on_data(remote, data):
            raise RuntimeError("the application's own bug")
        rs = Recorder()
        server = netio3.create("asyncmsg", rs.config(on_data_from_cb=on_data), loop)
        rc = Recorder()
        client = netio3.create("asyncmsg", rc.config(), loop)
        listening = server.open_listen_endpoint(("127.0.0.1", 0))
        client.open_active_endpoint(listening)
        assert drive(loop, lambda: rc.established)
        for key in range(3):
            client.send_data_copy(listening, b"x", None, key)
        assert drive(loop, lambda: len(seen) == 3 and len(rc.completed) == 3)
        assert "the application's own bug" in str(seen[0].exc_value)
        assert "on_data_from_cb" in str(seen[0].object)
        client.close()
        server.close()
    finally:
        sys.unraisablehook = old


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_loop_on_a_thread_of_its_own(backend):
    loop = netio3.EpollEventLoop()
    threads = set()
    done = threading.Event()
    received = []

    def on_data(remote, data):
        threads.add(threading.get_ident())
        received.append(data)
        if len(received) == 100:
            done.set()

    rs = Recorder()
    server = netio3.create(backend, rs.config(on_data_from_cb=on_data), loop)
    rc = Recorder()
    connected = threading.Event()
    client = netio3.create(backend, rc.config(
        on_connection_established_cb=lambda remote, caps: connected.set()), loop)
    runner = threading.Thread(target=loop.run)
    runner.start()
    try:
        listening = server.open_listen_endpoint(("127.0.0.1", 0),
                                                netio3.ConnectionParameters(RECV))
        client.open_active_endpoint(listening, netio3.ConnectionParameters(
            send_buffered_params=netio3.SendBufferedParameters(4096, 128)))
        assert connected.wait(20)
        for i in range(100):
            buffer = client.get_buffer(listening)
            buffer.write(i.to_bytes(4, "little"))
            assert client.send_buffer(listening, buffer) == netio3.NetioStatus.OK
        assert done.wait(20)
        assert threads == {runner.ident}
        assert [int.from_bytes(d, "little") for d in received] == list(range(100))
        client.close()  # from this thread while the loop runs on the other: no deadlock
        server.close()
    finally:
        loop.stop()
        runner.join(20)
    assert not runner.is_alive()


def test_ctrl_c_raises_keyboard_interrupt_out_of_run():
    loop = netio3.EpollEventLoop()
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        loop.run()  # idle: asleep in the kernel until the signal
    timer.join()
    assert not loop.is_running()


def test_post_and_run_sync_and_timers(loop):
    ran = []
    loop.post(lambda: ran.append("posted"))
    timer = loop.create_timer(lambda: ran.append("timer"))
    timer.start_once(0.01)
    assert drive(loop, lambda: ran == ["posted", "timer"])
    loop.run_sync(lambda: ran.append("sync"))  # on the loop's thread: at once
    assert ran[-1] == "sync"
    result = []
    worker = threading.Thread(target=lambda: loop.run_sync(lambda: result.append(
        threading.get_ident())))
    worker.start()
    assert drive(loop, lambda: result)
    worker.join()
    assert result == [threading.get_ident()]
    timer.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_count_what_happened(loop, backend):
    params = netio3.ConnectionParameters(
        send_buffered_params=netio3.SendBufferedParameters(buf_size=4096, num_buf=8))
    server, client, rs, rc, listening = pair(loop, backend, params)
    for _ in range(5):
        buffer = client.get_buffer(listening)
        buffer.write(b"12345")
        assert client.send_buffer(listening, buffer) == netio3.NetioStatus.OK
    assert drive(loop, lambda: len(rc.completed) == 5 and len(rs.data) == 5)
    stats = client.statistics(listening)
    assert stats.remote == listening and stats.open
    assert stats.sends_accepted == 5 and stats.sends_completed == 5 and stats.bytes_sent == 25
    assert [s.remote for s in client.connection_statistics()] == [listening]
    total = server.backend_statistics()
    assert total.messages_received == 5 and total.bytes_received == 25
    client.close()
    server.close()


def test_network_limits_take_their_members_as_keywords():
    limits = netio3.NetworkLimits(connect_timeout=2, peer_timeout=0.5, max_message_size=4096)
    assert limits.connect_timeout == 2.0
    assert limits.peer_timeout == 0.5
    assert limits.max_message_size == 4096
    assert netio3.NetworkLimits().connect_timeout == 10.0  # the C++ default
    assert netio3.NetworkLimits().max_interrupted_sessions == 1024
    assert netio3.NetworkLimits(max_interrupted_sessions=8).max_interrupted_sessions == 8
    with pytest.raises(TypeError):
        netio3.NetworkLimits(connect_timeout="soon")
