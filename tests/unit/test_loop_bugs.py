"""The tests' guard against a service loop that fails on a bug and goes on (batchline/testing/loop_bugs.py):
in process, and in a service's log file. Records are handed to the guard directly: logged, they
would fail this test through the real one."""
from __future__ import annotations

import logging
import sys

import redis.exceptions

from batchline.testing.loop_bugs import LoopBugs, in_log


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


# A scheduler's log as batchline.logs writes it, with a step that failed on a bug.
_STEP_BUG = """2026-11-28 11:20:47,870 scheduler INFO scheduler.service: leading
2026-11-28 11:20:47,876 scheduler ERROR scheduler.service: scheduling step failed
Traceback (most recent call last):
  File "/work/main/scheduler/service.py", line 125, in _loop
    wake_at = await self.step() if await self._hold_lease() else None
              ^^^^^^^^^^^^^^^^^
  File "/work/main/batchline/contract/link.py", line 297, in execute
    for reply in replies:
TypeError: 'int' object is not iterable
2026-11-28 11:20:48,001 scheduler INFO scheduler.service: dispatched"""

# Redis going away, a chained failure that ends in it, and a bug in a loop the guard does not watch.
_OUTAGES = """2026-11-28 11:21:00,000 scheduler ERROR scheduler.wakeups: waiting for events failed
Traceback (most recent call last):
  File "/work/main/scheduler/wakeups.py", line 70, in listen
    raise KeyError("x")
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/work/main/scheduler/wakeups.py", line 72, in listen
    await self.store.listen()
redis.exceptions.ConnectionError: Error 111 connecting to 127.0.0.1:6379. Connection refused.
2026-11-28 11:21:01,000 executor ERROR executor.batch_worker: batch b1 failed
Traceback (most recent call last):
  File "/work/main/executor/batch_worker.py", line 111, in _work_loop
TypeError: a bad model's batch
2026-11-28 11:21:02,000 gateway ERROR gateway.core: heartbeat failed"""


def test_a_loop_failure_on_a_bug_is_found_in_a_log_with_its_traceback():
    found = in_log(_OUTAGES + "\n" + _STEP_BUG + "\n" + _STEP_BUG)
    assert found is not None and found.startswith("2 failure(s) of a service loop on a bug in its log; the first:")
    assert "ERROR scheduler.service: scheduling step failed" in found
    assert found.rstrip().endswith("TypeError: 'int' object is not iterable") and "dispatched" not in found


def test_outages_chained_ones_and_other_loggers_in_a_log_are_not_bugs():
    assert in_log(_OUTAGES) is None
    assert in_log(_STEP_BUG.replace("TypeError", "redis.exceptions.TimeoutError")) is None
    assert in_log("") is None


def test_a_mesh_that_outlives_a_test_has_each_failure_read_once(tmp_path):
    """A module's ProcessMesh is read after every test: each read takes only what its logs gained
    (a failure fails the test it came in, not the module's next ones), and a traceback still being
    written is read whole the next time."""
    from batchline.testing.processes import ProcessMesh, Service

    mesh = ProcessMesh(tmp_path / "repo", tmp_path / "logs", models=())
    try:
        log = tmp_path / "logs" / "scheduler.log"
        mesh.services["scheduler"] = Service("scheduler", "scheduler", [], {}, log)  # its log alone
        log.write_text(_STEP_BUG + "\n")
        assert "TypeError: 'int' object is not iterable" in (mesh.loop_bugs() or "")
        assert mesh.loop_bugs() is None  # read already
        head, _, tail = _STEP_BUG.partition("  File")
        with log.open("a") as f:
            f.write(head + "  File")  # the traceback's first lines, as the service writes them
        assert mesh.loop_bugs() is None
        with log.open("a") as f:
            f.write(tail + "\n")
        assert "TypeError: 'int' object is not iterable" in (mesh.loop_bugs() or "")
    finally:
        mesh.stop()
    assert mesh.stopped
