"""The code passes ruff with the project's rules (pyproject.toml's [tool.ruff]): errors such as
undefined or unused names and imports fail the suite, as they would fail a reviewer. The pure
packages pass mypy (pyproject.toml's [tool.mypy]): a planning function called with the wrong
type fails here, not in a scheduler at run time."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from batchline.testing.checkout import ROOT


def tool(name: str) -> str:
    found = shutil.which(name, path=str(pathlib.Path(sys.executable).parent)) or shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: it comes with the dev extra")
    return found


def ruff() -> str:
    return tool("ruff")


def mypy(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    # No cache: a run takes about two seconds cold, and leaves nothing in the work tree.
    return subprocess.run([tool("mypy"), "--cache-dir", os.devnull], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_code_passes_ruff():
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_reports_what_it_is_configured_to(tmp_path):
    # The configuration is the project's, not empty: in a copy of the rules, an unused import, a line
    # over 120 characters, a silent blind except and a noqa that silences nothing each fail.
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text(
        "import os\n"
        f"LONG = '{'x' * 120}'\n"
        "try:\n    LONG.upper()\nexcept Exception:\n    pass\n"
        "SHORT = 1  # noqa: E501\n")
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    for rule in ("F401", "E501", "BLE001", "RUF100"):
        assert rule in result.stdout, (rule, result.stdout)


def test_the_pure_packages_pass_mypy():
    result = mypy(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_checks_the_packages_it_is_configured_to(tmp_path):
    # The project's configuration, on a copy of the packages it names: a planning function without
    # annotations, and a wrong type in the contract, both fail.
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    for package in ("batchline", "batchline/planning", "batchline/contract"):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "batchline/planning/bad.py").write_text("def rows(batch):\n    return len(batch)\n")
    (tmp_path / "batchline/contract/bad.py").write_text("TTL_MS: int = '60000'\n")
    result = mypy(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "planning/bad.py:1: error" in result.stdout and "[no-untyped-def]" in result.stdout, result.stdout
    assert "contract/bad.py:1: error" in result.stdout and "[assignment]" in result.stdout, result.stdout
