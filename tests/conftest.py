from __future__ import annotations

import os
import pathlib

import pytest

from batchline.demo_models import build_repository
from batchline.embedded_redis import EmbeddedRedis
from batchline.testing import processes
from batchline.testing.checkout import ROOT
from batchline.testing.loop_bugs import watched
from batchline.testing.processes import ProcessMesh


@pytest.fixture(autouse=True)
def no_bug_in_a_service_loop():
    """Fails the test during which a service loop failed on a bug (batchline/testing/loop_bugs.py):
    one of a mesh in this process, or one whose log a ProcessMesh holds (one the test made, or a
    module's that outlives it: what its logs gained since the last test)."""
    with watched() as bugs:
        yield
    found = bugs.report()
    for mesh in processes.MADE:
        bug = mesh.loop_bugs()  # (each read, so that its next read starts after this test)
        found = found or bug
    processes.MADE[:] = [mesh for mesh in processes.MADE if not mesh.stopped]
    if found:
        pytest.fail(found, pytrace=False)


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
    from batchline.testing.in_process import InProcessMesh

    with InProcessMesh(redis_server.url, str(model_repository)) as m:
        yield m


@pytest.fixture
def mesh_factory(model_repository):
    """Start meshes with other shapes (more executors, scheduler or gateway overrides), each on a
    private Redis so it cannot disturb (or be served by) any other mesh; stopped after the test."""
    from batchline.testing.in_process import InProcessMesh

    started = []

    def make(**kwargs) -> "InProcessMesh":
        m = InProcessMesh(None, str(model_repository), **kwargs).start()
        started.append(m)
        return m

    yield make
    for m in started:
        m.stop()


@pytest.fixture
def process_mesh(request, model_repository, tmp_path):
    """Makes ProcessMeshes whose logs go under this test's tmp dir; all are stopped after
    the test, and their logs printed when it failed."""
    meshes: list[ProcessMesh] = []
    failed_before = request.session.testsfailed

    def make(**kwargs) -> ProcessMesh:
        m = ProcessMesh(model_repository, tmp_path / f"mesh-{len(meshes)}", **kwargs)
        meshes.append(m)
        return m

    yield make
    for m in meshes:
        m.stop()
    if request.session.testsfailed > failed_before:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        for m in meshes:
            text = f"\n===== service logs of {request.node.name} ({m.log_dir}) =====\n{m.logs(80)}\n"
            if reporter is not None:
                reporter.write_line(text)
            else:  # pragma: no cover - -p no:terminal
                print(text)


@pytest.fixture(scope="module")
def mlp_model(model_repository):
    return model_repository / "mlp" / "1" / "model.onnx"
