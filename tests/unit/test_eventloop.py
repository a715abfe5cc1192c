"""Services and the load generator run on uvloop unless told otherwise."""
from __future__ import annotations

import asyncio

import pytest

from batchline import eventloop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_by_default(monkeypatch):
    pytest.importorskip("uvloop")
    monkeypatch.delenv("BATCHLINE_EVENT_LOOP", raising=False)
    assert eventloop.run(_loop_module()).startswith("uvloop")


def test_the_stdlib_loop_on_request(monkeypatch):
    monkeypatch.setenv("BATCHLINE_EVENT_LOOP", "asyncio")
    assert eventloop.run(_loop_module()).startswith("asyncio")


def test_run_returns_the_coroutines_result_and_closes_its_loop():
    loops = []

    async def work():
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return 42

    assert eventloop.run(work()) == 42
    assert loops[0].is_closed()
