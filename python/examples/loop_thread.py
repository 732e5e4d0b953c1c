"""The netio3 loop on a thread of its own (docs/python.md, "Threads and the GIL"): an
application whose main thread does other work runs loop.run() on a threading.Thread; the
callbacks run there, with the GIL, and talk to the main thread through a queue.

Run: python3 loop_thread.py [asyncmsg|libfabric|ucx]
"""

import queue
import sys
import threading

import netio3


def main(backend="asyncmsg", count=1000):
    # [thread]
    loop = netio3.EpollEventLoop()
    events = queue.Queue()  # callbacks (loop thread) -> main thread
    receiver = netio3.create(backend, netio3.NetworkConfig(
        on_data_cb=lambda data: events.put(("data", data))), loop)
    sender = netio3.create(backend, netio3.NetworkConfig(
        thread_safety=netio3.ThreadSafetyModel.SAFE,  # called from the main thread
        on_connection_established_cb=lambda remote, caps: events.put(("connected", remote)),
        on_ready_to_send_cb=lambda remote: events.put(("ready", remote))), loop)
    runner = threading.Thread(target=loop.run, name="netio3 loop")
    runner.start()

    server = receiver.open_listen_endpoint(("127.0.0.1", 0), netio3.ConnectionParameters(
        recv_params=netio3.RecvParameters(buf_size=64, num_buf=256)))
    sender.open_active_endpoint(server, netio3.ConnectionParameters(
        send_buffered_params=netio3.SendBufferedParameters(buf_size=64, num_buf=32)))
    assert events.get(timeout=10) == ("connected", server)
    got = []
    for i in range(count):
        while (buffer := sender.get_buffer(server)) is None:
            # All 32 buffers in flight: the ready callback says when one is back (the
            # main thread may have seen "data" events meanwhile).
            while (event := events.get(timeout=10))[0] != "ready":
                got.append(event[1])
        buffer.write(i.to_bytes(4, "little"))
        assert sender.send_buffer(server, buffer) == netio3.NetioStatus.OK
    while len(got) < count:
        kind, value = events.get(timeout=10)
        if kind == "data":
            got.append(value)
    loop.stop()
    runner.join()
    sender.close()
    receiver.close()
    # [thread]
    return [int.from_bytes(g, "little") for g in got]


if __name__ == "__main__":
    numbers = main(*sys.argv[1:])
    print(f"{len(numbers)} messages, in order: {numbers == list(range(len(numbers)))}")
