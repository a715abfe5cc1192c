from __future__ import annotations

import os
import pathlib
import sys

import pytest

from batchline.demo_models import build_repository
from batchline.embedded_redis import EmbeddedRedis

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # tests/mesh.py


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


@pytest.fixture(scope="module")
def mesh(redis_server, model_repository):
    """One gateway, one scheduler and one executor serving the demo models (shared by a test module)."""
    from mesh import Mesh

    with Mesh(redis_server.url, str(model_repository)) as m:
        yield m


@pytest.fixture
def mesh_factory(model_repository):
    """Start meshes with other shapes (more executors, scheduler or gateway overrides), each on a
    private Redis so it cannot disturb (or be served by) any other mesh; stopped after the test."""
    from mesh import Mesh

    started = []

    def make(**kwargs) -> "Mesh":
        m = Mesh(None, str(model_repository), **kwargs).start()
        started.append(m)
        return m

    yield make
    for m in started:
        m.stop()
