"""Commit subjects are at most 72 characters (scripts/check_commits.py, run by `./dev.sh lint`):
this checkout's commits pass, and the check fails on a real repository whose commits break the rule,
leaves history from before the rule alone, and checks a shallow clone as far as it goes."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from batchline.testing.checkout import ROOT

SCRIPT = ROOT / "scripts" / "check_commits.py"
AFTER_RULE = "2026-11-27T12:00:00+00:00"
BEFORE_RULE = "2026-11-20T12:00:00+00:00"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def check(repo: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--repo", str(repo), *args], capture_output=True, text=True,
                          timeout=60)


def git(repo: pathlib.Path, *args: str, when: str = AFTER_RULE) -> str:
    env = {**os.environ, "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when}
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          env=env, check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def commit(repo: pathlib.Path, message: str, when: str = AFTER_RULE) -> str:
    git(repo, "commit", "--allow-empty", "-q", "-m", message, when=when)
    return git(repo, "rev-parse", "--short", "HEAD")


@pytest.fixture
def repo(tmp_path) -> pathlib.Path:
    git(tmp_path, "init", "-q", "-b", "main")
    return tmp_path


def test_this_checkout_passes():
    result = check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_subject_over_72_characters_fails_and_is_named(repo):
    commit(repo, "x" * 72)
    long = commit(repo, "y" * 73)
    result = check(repo)
    assert result.returncode == 1, result.stdout + result.stderr
    assert long in result.stderr and "73 characters" in result.stderr, result.stderr
    assert "2 commit(s) checked, 1 problem(s)" in result.stdout


def test_a_body_needs_a_blank_line_after_the_subject(repo):
    commit(repo, "subject\nbody straight after it")
    result = check(repo)
    assert result.returncode == 1 and "no blank line" in result.stderr, result.stdout + result.stderr
    commit(repo, "subject\n\nbody after a blank line")
    assert check(repo, "--base", "HEAD~1").returncode == 0


def test_history_from_before_the_rule_is_left_alone(repo):
    commit(repo, "z" * 90, when=BEFORE_RULE)
    commit(repo, "a short one")
    result = check(repo)
    assert result.returncode == 0 and "1 commit(s) checked" in result.stdout, result.stdout + result.stderr


def test_base_checks_only_the_branchs_own_commits(repo):
    commit(repo, "m" * 80)
    git(repo, "checkout", "-q", "-b", "topic")
    commit(repo, "the branch's own commit")
    assert check(repo, "--base", "main").returncode == 0
    assert check(repo).returncode == 1  # the rule's own window reaches main's long subject


def test_a_shallow_clone_is_checked_as_far_as_it_goes(repo, tmp_path_factory):
    commit(repo, "o" * 80)
    commit(repo, "the newest commit")
    clone = tmp_path_factory.mktemp("shallow") / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(clone)], check=True, timeout=60)
    result = check(clone)
    assert result.returncode == 0 and "1 commit(s) checked (a shallow clone" in result.stdout, result.stdout
    # A base the clone lacks is no failure: there is nothing to compare with.
    missing = check(clone, "--base", "main~1")
    assert missing.returncode == 0 and "not in this clone" in missing.stdout, missing.stdout + missing.stderr


def test_outside_a_git_checkout_nothing_is_checked(tmp_path):
    result = check(tmp_path)
    assert result.returncode == 0 and "nothing to check" in result.stdout, result.stdout + result.stderr
