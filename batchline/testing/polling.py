"""The one polling helper of the tests and the soak benchmark, and the error its waits raise."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class MeshError(AssertionError):
    """The mesh did not reach a state in time, or a service died unexpectedly."""


def poll(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05,
         check: Callable[[], None] | None = None) -> T:
    """Wait until condition() is truthy and return it; MeshError after `timeout` seconds.

    `check` runs on every round so that a crashed service fails the wait at once
    instead of after the whole timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise MeshError(f"timed out after {timeout:.1f} s waiting for {what} (last value: {value!r})")
        time.sleep(interval)
