from __future__ import annotations

import os
import pathlib

import pytest

from batchline.demo_models import build_repository
from batchline.embedded_redis import EmbeddedRedis

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server():
    """A private Redis on a free port, for this test session only."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def model_repository() -> pathlib.Path:
    """The demo repository, built once and cached across runs (the build is deterministic)."""
    path = pathlib.Path(os.environ.get("BATCHLINE_TEST_REPOSITORY", ROOT / ".cache" / "model_repository"))
    return build_repository(path)
