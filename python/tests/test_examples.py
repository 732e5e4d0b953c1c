"""Every program of docs/python.md (python/examples/) on every backend."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from helpers import BACKENDS

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", BACKENDS)
async def test_echo(backend):
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
