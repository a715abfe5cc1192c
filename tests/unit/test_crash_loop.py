"""The supervisor's judgement of a crash loop, on its own with the time passed in: a service that
dies a little after each start is a loop even when the doubling backoff spreads its crashes past the
window; one whose runs last is never one."""
from __future__ import annotations

import argparse
import types

import pytest

from batchline.supervisor import STABLE_S, CrashLoop, Service, Supervisor


def _supervisor(max_restarts: int) -> tuple[Supervisor, Service]:
    args = argparse.Namespace(max_restarts=max_restarts, log_format="text", quiet=True)
    supervisor = Supervisor(args, "redis://127.0.0.1:1/0", None)
    service = Service("executor-1", ["true"], {})
    supervisor.services.append(service)
    return supervisor, service


def _run_and_crash(supervisor: Supervisor, service: Service, now: float, ran_s: float) -> float:
    """The service started at `now`, crashed `ran_s` later; when its restart is due."""
    service.proc, service.started_at = types.SimpleNamespace(pid=4242), now  # type: ignore[assignment]
    supervisor._crashed(service, 1, now + ran_s)
    assert service.restart_at is not None
    return service.restart_at


@pytest.mark.parametrize("ran_s", [12.0, 20.0, 29.0])
def test_a_service_that_dies_a_while_after_each_start_is_a_crash_loop(ran_s):
    supervisor, service = _supervisor(max_restarts=5)
    now = 0.0
    for _ in range(5):  # the backoff (0.5 s doubling to 10 s) spreads these past the 60 s window
        now = _run_and_crash(supervisor, service, now, ran_s)
    assert len(service.crashes) <= 5  # the window alone would restart it forever
    with pytest.raises(CrashLoop, match=r"executor-1 crashed 6 times in a row, each within 30 s of its start"):
        _run_and_crash(supervisor, service, now, ran_s)


def test_a_service_whose_runs_last_is_restarted_whenever_it_dies():
    supervisor, service = _supervisor(max_restarts=2)
    now = 0.0
    for _ in range(20):
        now = _run_and_crash(supervisor, service, now, STABLE_S + 1) + 60  # each run long, each crash alone
    assert service.unstable == 1


def test_a_lasting_run_between_quick_crashes_starts_the_count_again():
    supervisor, service = _supervisor(max_restarts=3)
    now = 0.0
    for ran_s in (5, 5, 5, STABLE_S + 5, 5, 5):
        now = _run_and_crash(supervisor, service, now, ran_s) + 60
    assert service.unstable == 3  # the lasting run's own crash, then two quick ones
    with pytest.raises(CrashLoop, match="4 times in a row"):
        _run_and_crash(supervisor, service, now, 5)


def test_a_retired_service_that_outlasts_the_stop_timeout_is_killed(monkeypatch):
    import subprocess
    import sys

    from batchline import supervisor as sup

    supervisor, service = _supervisor(max_restarts=5)
    # A real process that ignores SIGTERM, as a drain stuck in a model's run would.
    service.proc = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                     "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                                     "time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert service.proc.stdout.readline() == b"up\n"
        supervisor.retire("executor-1")
        supervisor.supervise()
        assert service.proc.poll() is None and service in supervisor.services  # draining: left alone
        monkeypatch.setattr(sup.time, "monotonic", lambda: service.retiring_since + sup.STOP_TIMEOUT_S + 1)
        supervisor.supervise()
        assert service.proc.returncode is not None and service not in supervisor.services
    finally:
        if service.proc.poll() is None:
            service.proc.kill()
        service.proc.wait()


def test_up_writes_each_of_its_lines_whole_in_one_write():
    """`batchline up` shares its terminal or pipe with the services it starts: a line of its own
    written as text and newline apart lets a service's line land between them (two JSON objects
    on one line where --log-format json promises one a line)."""

    from batchline.supervisor import say

    class Writes:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    out = Writes()
    say(argparse.Namespace(log_format="json"), "batchline: stopping", out)
    (line,) = out.calls
    assert line.endswith("}\n") and line.count("\n") == 1
