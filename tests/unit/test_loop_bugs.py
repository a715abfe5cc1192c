"""The tests' guard against a service loop that fails on a bug and goes on (batchline/testing/loop_bugs.py).
Records are handed to the guard directly: logged, they would fail this test through the real one."""
from __future__ import annotations

import logging
import sys

import redis.exceptions

from batchline.testing.loop_bugs import LoopBugs


def _failed(logger: str, exc: Exception | None, level: int = logging.ERROR) -> logging.LogRecord:
    """The record `log.exception("scheduling step failed")` makes in `logger` while `exc` is handled."""
    info = None
    if exc is not None:
        try:
            raise exc
        except type(exc):
            info = sys.exc_info()
    return logging.getLogger(logger).makeRecord(logger, level, __file__, 1, "scheduling step failed", (), info)


def test_a_loop_failing_on_a_bug_is_reported_with_its_traceback():
    bugs = LoopBugs()
    bugs.handle(_failed("scheduler.service", TypeError("'int' object is not iterable")))
    found = bugs.report()
    assert found is not None and found.startswith("1 failure(s) of a service loop on a bug; the first, "
                                                  "scheduler.service: scheduling step failed")
    assert "TypeError: 'int' object is not iterable" in found and "_failed" in found


def test_outages_other_loggers_and_plain_errors_are_not_bugs():
    bugs = LoopBugs()
    bugs.handle(_failed("scheduler.service", redis.exceptions.ConnectionError("Connection refused")))
    bugs.handle(_failed("scheduler.service", OSError("Broken pipe")))
    bugs.handle(_failed("executor.batch_worker", TypeError("a bad model's batch: answered INTERNAL")))
    bugs.handle(_failed("gateway.core", None))
    bugs.handle(_failed("gateway.core", KeyError("x"), level=logging.WARNING))
    assert bugs.report() is None
