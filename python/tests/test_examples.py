"""Every program of docs/python.md (python/examples/) on every backend; echo.py is the echo
server and client of the UCX-Py documentation written with netio3."""

from __future__ import annotations

import pytest

from helpers import BACKENDS, load_example as load


@pytest.mark.parametrize("backend", BACKENDS)
async def test_echo_the_ucx_py_documentations_echo_server_and_client(backend):
    assert await load("echo").main(backend) == b"hello, world"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_stream(backend):
    await load("stream").main(backend, count=64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_callbacks(backend):
    received, completed = load("callbacks").main(backend, count=100)
    assert received == list(range(100))
    assert completed == list(range(100))


@pytest.mark.parametrize("backend", BACKENDS)
def test_loop_thread(backend):
    assert load("loop_thread").main(backend, count=1000) == list(range(1000))
