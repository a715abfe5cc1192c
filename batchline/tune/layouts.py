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
    """Set a top-level `key = value` in config.toml text, keeping the rest, comments included: in
    place (a comment after the old value stays), or, for a key not there, just before the first
    [table] and the comments that head it. A key written as a table (`[version_policy]`) is replaced
    by the line. TuneError when the result is not the same config with `key` alone changed."""
    import tomllib

    from batchline.tune.run import TuneError

    before = tomllib.loads(text)
    lines = text.splitlines(keepends=True)
    lines = _without_table(lines, key)
    line = re.compile(rf"^{re.escape(key)}\s*=")
    first_table = next((i for i, x in enumerate(lines) if x.lstrip().startswith("[") and _is_header(x)), len(lines))
    at = next((i for i in range(first_table) if line.match(lines[i])), None)
    if at is not None:
        comment = _trailing_comment(lines[at])
        lines[at] = f"{key} = {value}" + (f"  {comment}" if comment else "") + "\n"
    else:
        at = first_table
        while at > 0 and (lines[at - 1].lstrip().startswith("#") or not lines[at - 1].strip()):
            at -= 1  # the comments that head the first table stay with it
        if at and not lines[at - 1].endswith("\n"):
            lines[at - 1] += "\n"
        lines.insert(at, f"{key} = {value}\n")
    out = "".join(lines)
    try:
        after = tomllib.loads(out)
    except tomllib.TOMLDecodeError as exc:
        raise TuneError(f"setting {key} in config.toml would make it invalid TOML ({exc}): set it by hand") from None
    expected = {**before, key: tomllib.loads(f"{key} = {value}")[key]}
    if after != expected:
        raise TuneError(f"setting {key} in config.toml would change more than {key}: set it by hand")
    return out


def _is_header(line: str) -> bool:
    return bool(re.match(r"^\s*\[\[?\s*[A-Za-z0-9_.\"'-]+\s*\]\]?\s*(#.*)?$", line.rstrip("\n")))


def _without_table(lines: list[str], key: str) -> list[str]:
    """The lines without the table `[key]` (header and body) or its sub-tables, if there is one."""
    header = re.compile(rf"^\s*\[\s*{re.escape(key)}\s*(\.[^\]]*)?\]\s*(#.*)?$")
    out, dropping = [], False
    for x in lines:
        if _is_header(x):
            dropping = bool(header.match(x.rstrip("\n")))
        if not dropping:
            out.append(x)
    return out


def _trailing_comment(line: str) -> str:
    """The `# ...` comment after a one-line value (outside any string), or ''."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[i:].rstrip("\n").rstrip()
    return ""
