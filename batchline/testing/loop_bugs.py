"""A service loop that survives a failed step logs it and goes on, so a bug in a step passes a
test that only looks at answers: the step is retried, and a later one does the work. The tests'
conftest fails the test that was running when a loop of a mesh in its process failed on a
programming error (not Redis or the network going away, which the loops are built to ride out),
with the traceback the service logged."""
from __future__ import annotations

import contextlib
import logging
import traceback
from typing import Iterator

# The loggers of the services' survive-a-bad-step loops.
LOOPS = frozenset({"scheduler.service", "scheduler.wakeups", "gateway.core", "gateway.views", "executor.service"})
BUGS = (TypeError, AttributeError, NameError, AssertionError, IndexError, KeyError)


class LoopBugs(logging.Handler):
    """Collects the ERROR records of LOOPS whose exception is one of BUGS."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if (record.levelno >= logging.ERROR and record.name in LOOPS and record.exc_info
                and isinstance(record.exc_info[1], BUGS)):
            self.records.append(record)

    def report(self) -> str | None:
        """What failed, with the first failure's traceback; None when nothing did."""
        if not self.records:
            return None
        first = self.records[0]
        assert first.exc_info is not None
        return (f"{len(self.records)} failure(s) of a service loop on a bug; the first, {first.name}: "
                f"{first.getMessage()}\n" + "".join(traceback.format_exception(*first.exc_info)))


@contextlib.contextmanager
def watched() -> Iterator[LoopBugs]:
    """LoopBugs on the root logger for the duration of the block."""
    handler = LoopBugs()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
