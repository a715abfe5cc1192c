"""The code passes ruff with the project's rules (pyproject.toml's [tool.ruff]): errors such as
undefined or unused names and imports fail the suite, as they would fail a reviewer."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def ruff() -> str:
    found = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
    if not found:
        pytest.fail("ruff not found: it comes with the dev extra")
    return found


def test_the_code_passes_ruff():
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_reports_what_it_is_configured_to(tmp_path):
    # The configuration is the project's, not empty: an unused import in a copy of the rules fails.
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\n")
    result = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "F401" in result.stdout, result.stdout + result.stderr
