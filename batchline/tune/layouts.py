"""The layouts `batchline tune` tries for one executor, and how one is written into config.toml.

A layout is what config.toml says about how one executor runs a model: instance_count (runs at
once), intra_op_threads (threads of each run), max_batch_size, max_queue_delay_ms, and which
version serves. The candidates are the current layout, then on this host's cores: every split
of them into instances x threads (1 x all, all x 1, and the halves between) at the current
max_batch_size, and the best split's neighbours at half and twice it (`refine`), for each
version the repository holds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Layout:
    version: str
    instance_count: int
    intra_op_threads: int       # 0: cores / instance_count (the executor's default)
    max_batch_size: int
    max_queue_delay_ms: float

    def label(self, cores: int) -> str:
        threads = self.intra_op_threads or max(1, cores // self.instance_count)
        return (f"v{self.version}: {self.instance_count} x {threads} thread{'s' if threads > 1 else ''}, "
                f"batch {self.max_batch_size}, delay {self.max_queue_delay_ms:g} ms")

    def keys(self) -> dict[str, str]:
        """The config.toml keys (TOML values) that say this layout."""
        return {"instance_count": str(self.instance_count), "intra_op_threads": str(self.intra_op_threads),
                "max_batch_size": str(self.max_batch_size), "max_queue_delay_ms": f"{self.max_queue_delay_ms:g}"}


def splits(cores: int) -> list[tuple[int, int]]:
    """(instances, threads each) that use the cores: 1 x cores, ..., cores x 1 (halving)."""
    out, n = [], 1
    while n <= cores:
        out.append((n, max(1, cores // n)))
        n *= 2
    if out[-1][0] != cores:
        out.append((cores, 1))
    return out


def candidates(current: Layout, versions: list[str], cores: int) -> list[Layout]:
    """The first round: the current layout first, then each split at the current batch size, per version."""
    out = [current]
    for version in versions:
        for instances, threads in splits(cores):
            layout = Layout(version, instances, threads, current.max_batch_size, current.max_queue_delay_ms)
            if layout not in out and not _same(layout, current, cores):
                out.append(layout)
    return out


def refine(best: Layout, tried: list[Layout]) -> list[Layout]:
    """The second round: the best layout's batch size halved and doubled (a model with a batch dim)."""
    if best.max_batch_size <= 0:
        return []
    out = []
    for size in (best.max_batch_size // 2, best.max_batch_size * 2):
        layout = Layout(best.version, best.instance_count, best.intra_op_threads, size, best.max_queue_delay_ms)
        if size >= 1 and layout not in tried:
            out.append(layout)
    return out


def _same(a: Layout, b: Layout, cores: int) -> bool:
    """Whether two layouts run alike (threads 0 means cores / instances)."""
    threads = lambda x: x.intra_op_threads or max(1, cores // x.instance_count)  # noqa: E731
    return (a.version, a.instance_count, threads(a), a.max_batch_size, a.max_queue_delay_ms) == \
        (b.version, b.instance_count, threads(b), b.max_batch_size, b.max_queue_delay_ms)


def set_config(text: str, key: str, value: str) -> str:
    """Set a top-level `key = value` in config.toml text, keeping the rest: in place, or after the
    last top-level key (before the first [table] and the comments that head it)."""
    pattern = re.compile(rf"^{re.escape(key)}\s*=.*$", re.MULTILINE)
    if pattern.search(text):
        return pattern.sub(f"{key} = {value}", text, count=1)
    lines = text.splitlines(keepends=True)
    first_table = next((i for i, line in enumerate(lines) if line.startswith("[")), len(lines))
    keys = [i for i, line in enumerate(lines[:first_table]) if re.match(r"^[A-Za-z0-9_-]+\s*=", line)]
    at = keys[-1] + 1 if keys else 0
    if at and not lines[at - 1].endswith("\n"):
        lines[at - 1] += "\n"
    return "".join(lines[:at] + [f"{key} = {value}\n"] + lines[at:])
