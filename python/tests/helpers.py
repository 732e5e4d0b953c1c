"""Shared by the netio3 Python tests: the backends to run on, and a host loop for the
callback layer (every wait has a deadline; nothing sleeps to synchronise)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import select
import subprocess
import sys
import time

import netio3

BACKENDS = [backend.name.lower() for backend in netio3.available()]
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
PEER = str(pathlib.Path(__file__).with_name("peer.py"))


def load_example(name: str):
    """python/examples/NAME.py as a module (docs/python.md's programs)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drive(loop: netio3.EpollEventLoop, condition, timeout: float = 20.0) -> bool:
    """Runs rounds of `loop` (attached to this thread) until condition() holds or the
    deadline passes; sleeps on the loop's descriptor between rounds. Returns condition()."""
    deadline = time.monotonic() + timeout
    again = True
    while not condition():
        left = deadline - time.monotonic()
        if left <= 0:
            return bool(condition())
        if not again:
            select.select([loop.fileno()], [], [], left)
        again = not loop.run_once()
    return True


class Recorder:
    """A NetworkConfig whose callbacks record into lists."""

    def __init__(self):
        self.data: list = []
        self.established: list = []
        self.closed: list = []
        self.refused: list = []
        self.completed: list = []
        self.ready: list = []

    def config(self, **overrides) -> netio3.NetworkConfig:
        callbacks = dict(
            on_data_from_cb=lambda remote, data: self.data.append((remote, data)),
            on_connection_established_cb=lambda remote, caps: self.established.append(
                (remote, caps)),
            on_connection_closed_cb=lambda remote, keys: self.closed.append((remote, keys)),
            on_connection_refused_reason_cb=lambda remote, reason: self.refused.append(
                (remote, reason)),
            on_send_completed_cb=lambda remote, key: self.completed.append((remote, key)),
            on_ready_to_send_cb=lambda remote: self.ready.append(remote),
        )
        callbacks.update(overrides)
        return netio3.NetworkConfig(mode=netio3.NetworkMode.TCP, **callbacks)


def python(*args: str, **kwargs) -> subprocess.Popen:
    """Starts this interpreter on `args` with the package's path, output on pipes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def stop(process: subprocess.Popen) -> None:
    """Kills the child (also a stopped one), reaps it and closes its pipes."""
    if process.poll() is None:
        process.kill()
    process.communicate()


def read_line(process: subprocess.Popen, prefix: str, timeout: float = 20.0) -> str:
    """The first line of the child's stdout that starts with `prefix` (deadline: timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = process.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    raise TimeoutError(f"no line starting with {prefix!r} from {process.args}")
