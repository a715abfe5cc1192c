"""How soon the mesh serves again after Redis fails over: the failover tests, run --rounds times.

    python benchmarks/failover.py --rounds 5

The tests (tests/faults/test_sentinel.py, tests/faults/test_cluster.py) assert what must hold whatever the host's
load: no request lost, every call answered before its deadline, the calls outside the failover
window served. How long the failover and the recovery took is a timing, which a loaded CI host
stretches, so it is measured here: each round runs the kill tests once and reads the figures they
print. The table gives each figure's median and worst over the rounds.

- Sentinel, primary SIGKILLed under 8 in flight: kill to promotion, promotion to served again.
- Sentinel, failover that lacks a queued request: promotion to that request's UNAVAILABLE.
- Cluster, the primary of mlp's shard SIGKILLed: kill to promotion, promotion to served again.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

from _common import ROOT, f, machine, table

TESTS = [
    "tests/faults/test_sentinel.py::test_primary_killed_under_load",
    "tests/faults/test_sentinel.py::test_a_failover_fails_at_once_only_what_the_new_primary_lacks",
    "tests/faults/test_cluster.py::test_a_shard_s_primary_killed_under_load_fails_over_to_its_replica",
]
FIGURES = {
    "Sentinel: kill to promotion (s)": r"failover ([\d.]+) s \(kill to promotion\)",
    "Sentinel: promotion to served again (s)": r"\(kill to promotion\); served again ([\d.]+) s",
    "Sentinel: promotion to the lacked request's answer (s)": r"lacked request was answered ([\d.]+) s",
    "Cluster: kill to promotion (s)": r"replica promoted ([\d.]+) s after the kill",
    "Cluster: promotion to served again (s)": r"after the kill; served again ([\d.]+) s",
}


def one_round() -> dict[str, float]:
    done = subprocess.run([sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", *TESTS],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-4000:], file=sys.stderr)
        raise SystemExit(f"the failover tests failed (exit {done.returncode})")
    found = {}
    for name, pattern in FIGURES.items():
        match = re.search(pattern, done.stdout)
        if match:
            found[name] = float(match.group(1))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="times to run the failover tests (default: 3)")
    args = p.parse_args()
    rounds = []
    for n in range(args.rounds):
        rounds.append(one_round())
        print(f"round {n + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[-1].items()), flush=True)
    rows = [["figure", "median", "worst", "rounds"]]
    for name in FIGURES:
        values = [r[name] for r in rounds if name in r]
        rows.append([name, f(statistics.median(values), ".2f") if values else "-",
                     f(max(values), ".2f") if values else "-", str(len(values))])
    print(f"\n{machine()}; {args.rounds} rounds\n" + table(rows))


if __name__ == "__main__":
    main()
