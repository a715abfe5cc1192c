"""System shared memory through the mesh when the executor shares the gateway's host: the region
goes by reference (its bytes never cross Redis) and the executor reads the inputs and writes the
outputs itself; the answer is bit-identical to the same tensors sent in the message. And the
bytes copied through Redis when the executor cannot read the region, or runs on another host."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from batchline.redis_client import connect_sync
from batchline.testing import triton_models
from batchline.testing.polling import poll

# tritonclient 2.41's shared-memory utilities import pkg_resources, which warns that it is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:pkg_resources is deprecated")

ELEMENTS = 64 * 1024  # 256 KB of FP32 in, the same out


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from batchline.testing.in_process import InProcessMesh

    repo = triton_models.build_repository(tmp_path_factory.mktemp("repository"), names=["passthrough"])
    with InProcessMesh(None, str(repo), models=["passthrough"], gateway_overrides={"registry_refresh_s": 0.1},
                       executor_overrides={"heartbeat_interval_s": 0.1}) as m:
        yield m


@pytest.fixture
def region(mesh):
    """A region "io" holding the input at 0, with room for the output after it; the client, the data."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    data = np.random.default_rng(1).random((1, ELEMENTS), dtype=np.float32)
    client = grpcclient.InferenceServerClient(mesh.address)
    key = f"/bl_test_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("io", key, 2 * data.nbytes)
    shm.set_shared_memory_region(handle, [data])
    client.register_system_shared_memory("io", key, 2 * data.nbytes)
    try:
        yield client, handle, key, data
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


def _redis_in_bytes(mesh) -> int:
    return int(connect_sync(mesh.redis_url, 2).info("stats")["total_net_input_bytes"])


def _through_region(mesh, client, handle, data) -> tuple[np.ndarray, int]:
    """The answer (read from the region) and the bytes Redis received meanwhile."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    inputs = [grpcclient.InferInput("INPUT0", list(data.shape), "FP32")]
    inputs[0].set_shared_memory("io", data.nbytes)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
    outputs[0].set_shared_memory("io", data.nbytes, offset=data.nbytes)
    before = _redis_in_bytes(mesh)
    result = client.infer("passthrough", inputs, outputs=outputs)
    moved = _redis_in_bytes(mesh) - before
    assert result.get_output("OUTPUT0").parameters["shared_memory_byte_size"].int64_param == data.nbytes
    return shm.get_contents_as_numpy(handle, np.float32, data.shape, offset=data.nbytes).copy(), moved


def _set_host(mesh, host: str) -> None:
    """Make the executor advertise `host`, and wait until the gateway's registry shows it."""
    from batchline.regions import host_id

    for lane in mesh.executors[0].lanes:
        lane.host = host
    catalog = mesh.gateway.gateway.catalog
    poll(lambda: all(e.host == host for e in catalog.registry.executors.values()), 10,
         f"the gateway to see the executor's host {host!r} (its own: {host_id()!r})")


def test_a_region_on_the_executors_host_goes_by_reference_and_answers_as_the_message_does(mesh, region):
    import tritonclient.grpc as grpcclient

    client, handle, _, data = region
    _set_host(mesh, mesh.executors[0].executor.host)
    got, moved = _through_region(mesh, client, handle, data)
    inputs = [grpcclient.InferInput("INPUT0", list(data.shape), "FP32")]
    inputs[0].set_data_from_numpy(data)
    before = _redis_in_bytes(mesh)
    in_message = client.infer("passthrough", inputs).as_numpy("OUTPUT0")
    moved_in_message = _redis_in_bytes(mesh) - before
    assert got.tobytes() == in_message.tobytes() == data.tobytes()
    # The tensors crossed Redis twice in the message (request, answer); a reference is a few hundred bytes.
    assert moved_in_message > 2 * data.nbytes and moved < data.nbytes // 8, (moved, moved_in_message)


def test_a_region_the_executor_cannot_open_as_registered_is_copied_and_answered(mesh, region):
    client, handle, key, data = region
    _set_host(mesh, mesh.executors[0].executor.host)
    # The client removes the file and makes another under the key: the gateway still holds the one
    # registered; the executor, opening the key, finds another file and must not read it.
    path = f"/dev/shm/{key[1:]}"
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(b"\xff" * 2 * data.nbytes)
    got, moved = _through_region(mesh, client, handle, data)  # the fixture's destroy removes the new file
    assert got.tobytes() == data.tobytes()
    assert moved > 2 * data.nbytes  # queued again with the bytes, and answered with them


def test_an_executor_on_another_host_gets_the_bytes(mesh, region):
    client, handle, _, data = region
    own = mesh.executors[0].executor.host
    _set_host(mesh, "another-host:1")
    try:
        got, moved = _through_region(mesh, client, handle, data)
    finally:
        _set_host(mesh, own)
    assert got.tobytes() == data.tobytes()
    assert moved > 2 * data.nbytes


def test_a_gateway_told_not_to_reference_regions_copies_them(mesh, region):
    client, handle, _, data = region
    _set_host(mesh, mesh.executors[0].executor.host)
    settings = mesh.gateway.gateway.settings
    settings.shared_memory_by_reference = False
    try:
        got, moved = _through_region(mesh, client, handle, data)
    finally:
        settings.shared_memory_by_reference = True
    assert got.tobytes() == data.tobytes()
    assert moved > 2 * data.nbytes
