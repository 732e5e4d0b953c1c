"""The C++ API one to one (docs/python.md, "The callback layer"): one process listens,
connects to itself, sends numpy arrays zero-copy and stops its loop once every send
completed and every message arrived. The loop runs on the main thread (loop.run()), every
callback on it.

Run: python3 callbacks.py [asyncmsg|libfabric|ucx]
"""

import sys

import numpy as np

import netio3


def main(backend="asyncmsg", count=100):
    # [callbacks]
    loop = netio3.EpollEventLoop()
    region = np.zeros((count, 1024), dtype=np.uint32)  # what the sends read, in place
    received = []
    completed = []
    server = None

    def on_established(remote, capabilities):
        if remote != server:
            return  # the accepted side
        for i in range(count):
            region[i] = i  # message i: 1024 words of i
            status = backend_.send_data(remote, region[i], header_data=None, key=i)
            assert status == netio3.NetioStatus.OK

    def on_data(remote, data):
        received.append(np.frombuffer(data, dtype=np.uint32)[0])
        if len(received) == count and len(completed) == count:
            loop.stop()

    def on_completed(remote, key):
        completed.append(key)  # region[key] may be written again
        if len(received) == count and len(completed) == count:
            loop.stop()

    backend_ = netio3.create(backend, netio3.NetworkConfig(
        mode=netio3.NetworkMode.TCP,
        on_connection_established_cb=on_established,
        on_send_completed_cb=on_completed,
        on_data_from_cb=on_data), loop)
    server = backend_.open_listen_endpoint(
        ("127.0.0.1", 0), netio3.ConnectionParameters(
            recv_params=netio3.RecvParameters(buf_size=4096, num_buf=count)))
    backend_.open_active_endpoint(server, netio3.ConnectionParameters(
        send_zero_copy_params=netio3.SendZeroCopyParameters(region)))  # UCX, libfabric: registered
    loop.run()  # until loop.stop()
    backend_.close()
    # [callbacks]
    return received, sorted(completed)


if __name__ == "__main__":
    received, completed = main(*sys.argv[1:])
    print(f"{len(received)} messages in order: {received == sorted(received)}, "
          f"{len(completed)} completions")
