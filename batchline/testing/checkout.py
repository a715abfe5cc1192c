"""Where the checkout is, for tests that read its files (docs/, deploy/, pyproject.toml) or run its
scripts: from here rather than from a test file's own path, which changes when tests move between
the folders of tests/."""
from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Triton's example clients, vendored unmodified: the tests run them against a mesh.
TRITON_EXAMPLES = ROOT / "tests" / "triton_examples"
