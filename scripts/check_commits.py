"""Check that commit subjects are at most 72 characters, with a blank line before any body.

Checks the commits reachable from HEAD that were committed since the rule took effect (RULE_SINCE;
older history is left as it was written), or those on HEAD and not on --base REV (a branch's own
commits: --base main). A shallow clone is checked as far as its history goes; outside a git
checkout, or where REV is not in the clone, nothing is checked. Exits 1 naming each commit that
breaks the rule.

    python scripts/check_commits.py [--base REV] [--repo PATH]
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys

MAX_SUBJECT = 72
# When this check landed: the commits before it stay as they were written (main has subjects
# over 72 characters up to then), since rewriting published history is worse.
RULE_SINCE = "2026-11-26T19:00:00+00:00"
# Fields and records split on characters that a commit message does not contain.
_FIELD, _RECORD = "\x1f", "\x1e"


def _git(repo: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)


def commits(repo: pathlib.Path, base: str | None) -> list[tuple[str, str]]:
    """(short hash, message) of each commit to check, newest first."""
    limit = [f"{base}..HEAD"] if base else [f"--since={RULE_SINCE}", "HEAD"]
    listed = _git(repo, "log", f"--format=%h{_FIELD}%B{_RECORD}", *limit)
    if listed.returncode != 0:
        raise SystemExit(f"check_commits: git log failed: {listed.stderr.strip()}")
    found = []
    for record in listed.stdout.split(_RECORD):
        if _FIELD in record:
            short, message = record.strip("\n").split(_FIELD, 1)
            found.append((short, message))
    return found


def problems(message: str) -> list[str]:
    lines = message.rstrip("\n").split("\n")
    found = []
    if len(lines[0]) > MAX_SUBJECT:
        found.append(f"subject of {len(lines[0])} characters (at most {MAX_SUBJECT})")
    if len(lines) > 1 and lines[1].strip():
        found.append("no blank line between the subject and the body")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", metavar="REV", help="check the commits on HEAD and not on REV instead (e.g. main)")
    parser.add_argument("--repo", default=".", help="the checkout to check (default: the current directory)")
    args = parser.parse_args(argv)
    repo = pathlib.Path(args.repo)
    if shutil.which("git") is None or _git(repo, "rev-parse", "--verify", "-q", "HEAD").returncode != 0:
        print("check_commits: not a git checkout with commits: nothing to check")
        return 0
    if args.base and _git(repo, "rev-parse", "--verify", "-q", f"{args.base}^{{commit}}").returncode != 0:
        print(f"check_commits: {args.base} is not in this clone: nothing to check")
        return 0
    shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    checked = commits(repo, args.base)
    bad = [(short, message.split("\n", 1)[0], why) for short, message in checked for why in problems(message)]
    for short, subject, why in bad:
        print(f"{short} {subject!r}: {why}", file=sys.stderr)
    print(f"check_commits: {len(checked)} commit(s) checked{' (a shallow clone: as far as it goes)' if shallow else ''}"
          f", {len(bad)} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
