"""A service loop that survives a failed step logs it and goes on, so a bug in a step passes a
test that only looks at answers: the step is retried, and a later one does the work. The tests'
conftest fails the test that was running when a loop of a mesh in its process failed on a
programming error (not Redis or the network going away, which the loops are built to ride out),
with the traceback the service logged; and, for meshes of real processes, the test whose
services' log files hold such a failure (`in_log`)."""
from __future__ import annotations

import contextlib
import logging
import re
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


# A text log's record head (batchline.logs: "<time> <service> <LEVEL> <logger>: <message>").
_HEAD = re.compile(r" ERROR (?P<logger>[\w.]+): ")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_BUG_NAMES = frozenset(b.__name__ for b in BUGS)


# A text record's first line starts with its time; a traceback's lines, and the lines that chain
# one to the next, follow it.
_RECORD = re.compile(rb"^\d{4}-\d\d-\d\d ")
_MID_TRACEBACK = (b"Traceback (most recent call last):", b" ", *(c.encode() for c in _CHAINED))


def judged_to(log: bytes) -> int:
    """How much of a log still being written `in_log` can judge now: its whole lines, less the last
    record where its traceback has not reached the exception's line yet (read whole later)."""
    end = log.rfind(b"\n") + 1
    lines = log[:end].splitlines(keepends=True)
    if not lines or (lines[-1].strip() and not lines[-1].startswith(_MID_TRACEBACK)):
        return end
    start = end
    for line in reversed(lines):
        start -= len(line)
        if _RECORD.match(line):
            return start
    return end


def in_log(text: str) -> str | None:
    """The first loop failure on a bug in a service's text log (its head and traceback, and how
    many there are), or None."""
    lines = text.splitlines()
    found: list[str] = []
    for i, line in enumerate(lines):
        head = _HEAD.search(line)
        if head is None or head.group("logger") not in LOOPS:
            continue
        end, last = _traceback_end(lines, i + 1)
        if last is not None and last.split(":", 1)[0].rsplit(".", 1)[-1] in _BUG_NAMES:
            found.append("\n".join(lines[i:end]))
    if not found:
        return None
    return f"{len(found)} failure(s) of a service loop on a bug in its log; the first:\n{found[0]}"


def _traceback_end(lines: list[str], j: int) -> tuple[int, str | None]:
    """Past the traceback that starts at line `j` (chained ones too): where it ends, and its last
    exception's line (None: no traceback there)."""
    last = None
    while j < len(lines) and lines[j].startswith("Traceback (most recent call last):"):
        j += 1
        while j < len(lines) and lines[j].startswith(" "):
            j += 1
        if j >= len(lines):
            break
        last = lines[j]
        j += 1
        if j + 2 < len(lines) and not lines[j] and lines[j + 1].startswith(_CHAINED) and not lines[j + 2]:
            j += 3
    return j, last
