"""Every test file sits in the folder of tests/ that scripts/test_groups.toml names for it (unit,
service, e2e, faults), and scripts/group_tests.py, which puts them there, moves what the table
names, refuses a test file the table lacks, and points the paths other files give at the new ones."""
from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess

import pytest

from batchline.testing.checkout import ROOT


def _grouping():
    spec = importlib.util.spec_from_file_location("group_tests", ROOT / "scripts" / "group_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grouping = _grouping()


def test_every_test_file_sits_in_the_folder_the_table_names():
    moves = grouping.plan(ROOT)
    assert not moves, "run `python scripts/group_tests.py`: " + ", ".join(
        f"{src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}" for src, dst in moves)
    assert not list((ROOT / "tests").glob("test_*.py")), "a test file directly under tests/"
    folders = {p.parent.relative_to(ROOT / "tests").as_posix() for p in grouping.find_test_files(ROOT / "tests")}
    assert folders <= set(grouping.FOLDERS), folders


def test_the_table_names_only_test_files_that_exist():
    assert grouping.absent(ROOT) == []


def _tree(root: pathlib.Path, table: str, files: dict[str, str]) -> None:
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "test_groups.toml").write_text(table)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_script_moves_what_the_table_names_and_rewrites_the_paths_given_for_it(tmp_path):
    _tree(tmp_path, 'unit = ["test_a.py"]\nfaults = ["test_b.py"]\n', {
        "tests/test_a.py": "def test_a():\n    pass\n",
        "tests/unit/test_b.py": '"""Like tests/test_a.py, and unlike mytests/test_a.py or tests/test_a.pyc."""\n',
        "docs/guide.md": "Run `pytest tests/test_a.py::test_a` and tests/unit/test_b.py.\n",
    })
    assert grouping.main(["--root", str(tmp_path), "--check"]) == 1
    assert (tmp_path / "tests" / "test_a.py").exists()  # --check moves nothing

    assert grouping.main(["--root", str(tmp_path)]) == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "tests").rglob("*.py")) == [
        "tests/faults/test_b.py", "tests/unit/test_a.py"]
    assert (tmp_path / "docs" / "guide.md").read_text() == (
        "Run `pytest tests/unit/test_a.py::test_a` and tests/faults/test_b.py.\n")
    assert (tmp_path / "tests" / "faults" / "test_b.py").read_text() == (
        '"""Like tests/unit/test_a.py, and unlike mytests/test_a.py or tests/test_a.pyc."""\n')
    # Idempotent: nothing left to move.
    assert grouping.main(["--root", str(tmp_path), "--check"]) == 0


def test_a_test_file_the_table_lacks_fails_the_run_and_nothing_moves(tmp_path, capsys):
    _tree(tmp_path, 'unit = ["test_a.py"]\n', {"tests/test_a.py": "", "tests/test_new.py": ""})
    assert grouping.main(["--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tests/test_new.py" in err and "unit, service, e2e, faults" in err, err
    assert sorted(p.name for p in (tmp_path / "tests").iterdir()) == ["test_a.py", "test_new.py"]


@pytest.mark.parametrize("table, says", [
    ('unit = ["test_a.py"]\nfaults = ["test_a.py"]\n', "named twice: test_a.py (unit and faults)"),
    ('smoke = ["test_a.py"]\n', "unknown folder(s) ['smoke']"),
])
def test_a_table_that_names_a_file_twice_or_an_unknown_folder_is_refused(tmp_path, capsys, table, says):
    _tree(tmp_path, table, {"tests/test_a.py": ""})
    assert grouping.main(["--root", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_in_a_git_checkout_the_move_is_a_rename_git_sees(tmp_path):
    _tree(tmp_path, 'e2e = ["test_a.py"]\n', {"tests/test_a.py": "def test_a():\n    pass\n"})
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=60)
    subprocess.run([*git, "add", "."], check=True, timeout=60)
    subprocess.run([*git, "commit", "-q", "-m", "tests"], check=True, timeout=60)
    assert grouping.main(["--root", str(tmp_path)]) == 0
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True, check=True,
                            timeout=60).stdout
    assert status == "R  tests/test_a.py -> tests/e2e/test_a.py\n", status
