"""Move the test files into the folders of tests/ that scripts/test_groups.toml names for them.

    python scripts/group_tests.py [--check] [--root PATH]

Reads the table, and fails (exit 2, moving nothing) listing every tests/**/test_*.py it does not
name, and any name it gives twice or under a folder other than unit, service, e2e and faults.
Otherwise moves each file not in its folder yet there (`git mv` where git tracks it), and rewrites
the paths other files give for a moved one (`tests/test_x.py` in the docs, comments and
pyproject.toml) to its new path. Deterministic and idempotent: after new test files are added to
the table, run it again. --check moves nothing, and exits 1 when something would move.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tomllib

FOLDERS = ("unit", "service", "e2e", "faults")
TABLE = pathlib.Path("scripts") / "test_groups.toml"
# Walked for references where git cannot list the tracked files.
_SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".cache", ".pytest_cache", "node_modules"}


class GroupingError(ValueError):
    """The table and the test files disagree: the message lists what to add or fix in the table."""


def load_table(path: pathlib.Path) -> dict[str, str]:
    """Test file name -> its folder."""
    raw = tomllib.loads(path.read_text())
    unknown = sorted(set(raw) - set(FOLDERS))
    if unknown:
        raise GroupingError(f"{path}: unknown folder(s) {unknown}; the folders are {', '.join(FOLDERS)}")
    folder_of: dict[str, str] = {}
    twice = []
    for folder in FOLDERS:
        for name in raw.get(folder, []):
            if name in folder_of:
                twice.append(f"{name} ({folder_of[name]} and {folder})")
            folder_of[name] = folder
    if twice:
        raise GroupingError(f"{path}: named twice: {', '.join(twice)}")
    return folder_of


def find_test_files(tests: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in tests.rglob("test_*.py") if not _SKIPPED_DIRS & set(p.parts))


def plan(root: pathlib.Path) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """(from, to) for every test file outside its folder; GroupingError for files the table lacks."""
    folder_of = load_table(root / TABLE)
    tests = root / "tests"
    files = find_test_files(tests)
    missing = [str(p.relative_to(root)) for p in files if p.name not in folder_of]
    if missing:
        raise GroupingError(f"{root / TABLE} does not name {len(missing)} test file(s): {', '.join(missing)}; "
                            f"add each under {', '.join(FOLDERS)}")
    names = [p.name for p in files]
    clashes = sorted({str(p.relative_to(root)) for p in files if names.count(p.name) > 1})
    if clashes:
        raise GroupingError(f"test files of the same name: {', '.join(clashes)}; pytest imports them by name")
    return [(p, tests / folder_of[p.name] / p.name) for p in files if p.parent != tests / folder_of[p.name]]


def absent(root: pathlib.Path) -> list[str]:
    """Names the table gives that no test file has (a file deleted or renamed since)."""
    present = {p.name for p in find_test_files(root / "tests")}
    return sorted(set(load_table(root / TABLE)) - present)


def _git(root: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)


def _tracked(root: pathlib.Path) -> list[pathlib.Path] | None:
    try:
        listed = _git(root, "ls-files", "-z")
    except FileNotFoundError:  # no git on this machine
        return None
    if listed.returncode != 0:
        return None
    return [root / name for name in listed.stdout.split("\0") if name]


def move(root: pathlib.Path, moves: list[tuple[pathlib.Path, pathlib.Path]]) -> None:
    tracked = set(_tracked(root) or ())
    for src, dst in moves:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src in tracked:
            result = _git(root, "mv", str(src.relative_to(root)), str(dst.relative_to(root)))
            if result.returncode != 0:
                raise GroupingError(f"git mv {src} {dst}: {result.stderr.strip()}")
        else:
            src.rename(dst)


def rewrite_references(root: pathlib.Path, moves: list[tuple[pathlib.Path, pathlib.Path]]) -> list[pathlib.Path]:
    """Point `tests/[folder/]test_x.py` in every text file at each moved file's new path; the files changed."""
    if not moves:
        return []
    new_path = {dst.name: dst.relative_to(root).as_posix() for _, dst in moves}
    folders = "|".join(FOLDERS)
    pattern = re.compile(rf"(?<![\w.-])tests/(?:(?:{folders})/)?({'|'.join(map(re.escape, new_path))})(?!\w)")
    files = _tracked(root)
    if files is None:
        files = [p for p in root.rglob("*") if p.is_file() and not _SKIPPED_DIRS & set(p.relative_to(root).parts)]
    changed = []
    for path in sorted(files):
        if not path.is_file():
            continue  # moved in this run, or deleted in the work tree
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        rewritten = pattern.sub(lambda m: new_path[m.group(1)], text)
        if rewritten != text:
            path.write_text(rewritten)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="move nothing; exit 1 when something would move")
    parser.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parent.parent),
                        help="the checkout (default: the one holding this script)")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.root).resolve()
    try:
        moves = plan(root)
        for src, dst in moves:
            print(f"{src.relative_to(root)} -> {dst.relative_to(root)}")
        if args.check:
            return 1 if moves else 0
        move(root, moves)
        for path in rewrite_references(root, moves):
            print(f"rewrote the test paths in {path.relative_to(root)}")
    except GroupingError as exc:
        print(f"group_tests: {exc}", file=sys.stderr)
        return 2
    for name in absent(root):
        print(f"group_tests: the table names {name}, which no test file is: remove it from {TABLE}")
    print(f"group_tests: {len(moves)} file(s) moved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
