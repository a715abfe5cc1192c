"""The fault tests' load and how they judge it: the mlp load a process mesh serves (8 requests in
flight, a 10 s budget each), and the verdicts on every request sent (nothing hung, every answer
right, nothing lost). tests/faults/test_faults.py says why these are the verdicts."""
from __future__ import annotations

import time

import numpy as np

from batchline.testing.load import LoadClient, Record, format_summary
from batchline.testing.polling import MeshError, poll
from batchline.testing.processes import ProcessMesh

BUDGET_S = 10.0
HANG_SLACK_S = 2.0


def load_for(mesh: ProcessMesh, mlp_model, **kwargs) -> LoadClient:
    return LoadClient(mesh.probe.gateway_address(), mlp_model, concurrency=8, budget_s=BUDGET_S, **kwargs)


def soft_poll(condition, timeout: float, interval: float = 0.005) -> bool:
    """Like poll, but only reports whether the condition was seen (for conditions that make
    a fault more telling but are not what the test asserts)."""
    try:
        poll(condition, timeout, "soft condition", interval=interval)
        return True
    except MeshError:
        return False


def watch_health(mesh: ProcessMesh, names: list[str], state: str, timeout: float) -> dict[str, bool]:
    """Poll every service's health Check together until each reported `state` once (or timeout)."""
    seen = {n: False for n in names}
    deadline = time.monotonic() + timeout
    while not all(seen.values()) and time.monotonic() < deadline:
        for n in names:
            seen[n] = seen[n] or mesh.probe.health(n) == state
        time.sleep(0.05)
    return seen


def served_again(load: LoadClient, since: float, timeout: float = 30.0) -> float:
    """When the mesh served again after a fault ended at `since`: the end of the first OK call sent
    after it, the load's or a probe's. The probes, sent one at a time from here, stand for new
    clients: the load's callers may all be waiting on requests the failover lost, which the
    gateway answers only after a grace for their replies."""
    rng = np.random.default_rng(7)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ok = [r.end for r in load.snapshot() if r.sent >= since and r.code == "OK"]
        if ok:
            return min(ok)
        if load.one(rng).code != "OK":
            time.sleep(0.02)
    raise MeshError(f"no call sent after the fault was answered OK within {timeout} s")


def between(records: list[Record], start: float, end: float = float("inf")) -> list[Record]:
    return [r for r in records if start <= r.sent < end]


def report(title: str, phases: list[tuple[str, list[Record]]], extra: str = "") -> None:
    print(f"\n== {title}")
    for label, recs in phases:
        print("  " + format_summary(label, recs))
    if extra:
        print("  " + extra)


def assert_nothing_hung(records: list[Record]) -> None:
    hung = [r for r in records if r.latency > BUDGET_S + HANG_SLACK_S]
    assert not hung, f"{len(hung)} call(s) outlived their {BUDGET_S} s budget by > {HANG_SLACK_S} s, e.g. {hung[:3]}"


def assert_answers_correct(records: list[Record]) -> None:
    wrong = [r for r in records if r.code == "OK" and not r.correct]
    assert not wrong, f"{len(wrong)} successful answer(s) did not match their request, e.g. {wrong[:3]}"


def assert_none_lost(records: list[Record]) -> None:
    lost = [r for r in records if r.code == "DEADLINE_EXCEEDED"]
    assert not lost, f"{len(lost)} request(s) lost (DEADLINE_EXCEEDED with a {BUDGET_S} s budget), e.g. {lost[:3]}"


def assert_all_ok(records: list[Record]) -> None:
    failed = [r for r in records if r.code != "OK"]
    assert not failed, f"{len(failed)} of {len(records)} request(s) failed, e.g. {failed[:5]}"
