"""Triton's own gRPC client examples (tests/triton_examples, unmodified) run as subprocesses
against a mesh serving models with the examples' names and tensors: shared memory, the image
clients (input format, classification), and the error texts the explicit-content examples check."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import uuid

import numpy as np
import pytest

from batchline.testing.checkout import TRITON_EXAMPLES as EXAMPLES
from batchline.testing import triton_models

# tritonclient 2.41's shared-memory utilities import pkg_resources, which warns that it is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:pkg_resources is deprecated")


@pytest.fixture(scope="module")
def triton_mesh(tmp_path_factory):
    from batchline.testing.in_process import InProcessMesh

    from batchline.testing.stateful_models import save_repeat_int32

    repo = triton_models.build_repository(tmp_path_factory.mktemp("triton_repository"))
    save_repeat_int32(repo)
    with InProcessMesh(None, str(repo), models=["simple", "simple_int8", "simple_string", triton_models.IMAGE_MODEL,
                                       "repeat_int32"]) as m:
        yield m


def run_example(name: str, *args: str, timeout: float = 120) -> str:
    """Run the example; its stdout, once it exited 0."""
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_simple_grpc_shm_client(triton_mesh):
    out = run_example("simple_grpc_shm_client.py", "-u", triton_mesh.address)
    assert "PASS: system shared memory" in out
    assert "15 + 1 = 16" in out
    # The example unregistered its regions: none is left mapped by the gateway.
    assert triton_mesh.gateway.gateway.shared_memory.regions == {}


def test_simple_grpc_shm_string_client(triton_mesh):
    out = run_example("simple_grpc_shm_string_client.py", "-u", triton_mesh.address)
    assert "PASS: system shared memory" in out


def test_grpc_explicit_int_content_client(triton_mesh):
    # The example exits 0 whatever the server says: the PASS line is what tells.
    out = run_example("grpc_explicit_int_content_client.py", "-u", triton_mesh.address)
    assert "PASS: explicit int" in out


def test_grpc_explicit_int8_content_client(triton_mesh):
    out = run_example("grpc_explicit_int8_content_client.py", "-u", triton_mesh.address)
    assert "PASS: explicit int8" in out


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> pathlib.Path:
    """Two images whose classes the model tells apart: a red one (class 0 wins) and a blue one (class 9)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    Image.new("RGB", (64, 48), (255, 0, 0)).save(folder / "a_red.png")
    Image.new("RGB", (64, 48), (0, 0, 255)).save(folder / "b_blue.png")
    return folder


def expected_classes(color: tuple[int, int, int], count: int) -> list[str]:
    means = np.array(color, dtype=np.float32)
    weights = np.arange(30, dtype=np.float32).reshape(3, 10) / 30.0
    scores = means @ weights
    return [f"{triton_models.IMAGE_LABELS[i]}" for i in np.argsort(-scores, kind="stable")[:count]]


@pytest.mark.parametrize("mode", [[], ["-a"], ["--streaming"]])
def test_image_client(triton_mesh, images, mode):
    out = run_example("image_client.py", "-i", "grpc", "-u", triton_mesh.address, "-m", triton_models.IMAGE_MODEL,
                      "-c", "3", "-b", "2", *mode, str(images))
    assert out.rstrip().endswith("PASS")
    # One request of two images: the red one's three classes, then the blue one's, each "score (index) = label".
    lines = [line.strip() for line in out.splitlines() if " = " in line]
    labels = [line.rsplit(" = ", 1)[1] for line in lines]
    assert labels == expected_classes((255, 0, 0), 3) + expected_classes((0, 0, 255), 3)


def test_grpc_image_client(triton_mesh, images):
    out = run_example("grpc_image_client.py", "-u", triton_mesh.address, "-m", triton_models.IMAGE_MODEL, "-c", "2",
                      str(images / "b_blue.png"))
    assert out.rstrip().endswith("PASS")
    assert [line.rsplit(" = ", 1)[1] for line in out.splitlines() if " = " in line] == expected_classes((0, 0, 255), 2)


def test_the_model_config_reports_format_and_labels(triton_mesh):
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.model_config_pb2 as mc

    client = grpcclient.InferenceServerClient(triton_mesh.address)
    config = client.get_model_config(triton_models.IMAGE_MODEL).config
    assert config.input[0].format == mc.ModelInput.FORMAT_NCHW
    assert config.output[0].label_filename == "labels.txt"
    assert client.get_model_config("simple").config.input[0].format == mc.ModelInput.FORMAT_NONE


def test_shm_regions_are_checked_by_name_and_bounds(triton_mesh):
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(triton_mesh.address)
    key = f"/bl_test_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("in", key, 128)
    try:
        shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32), np.ones(16, dtype=np.int32)])
        client.register_system_shared_memory("in", key, 128)
        with pytest.raises(InferenceServerException) as again:
            client.register_system_shared_memory("in", key, 128)
        assert "StatusCode.ALREADY_EXISTS" in again.value.status() and "'in'" in again.value.message()

        def infer(region: str, offset: int):
            inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
                      grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_shared_memory(region, 64, offset=offset)
            inputs[1].set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
            return client.infer("simple", inputs)

        # One input in the region, one in the message.
        assert infer("in", 0).as_numpy("OUTPUT0").tolist() == [list(range(1, 17))]
        for region, offset, words in [("nope", 0, ["'nope'", "register it"]), ("in", 100, ["'in'", "beyond"])]:
            with pytest.raises(InferenceServerException) as refused:
                infer(region, offset)
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert all(w in refused.value.message() for w in words), refused.value.message()
        with pytest.raises(InferenceServerException) as too_big:
            client.register_system_shared_memory("big", key, 4096)
        assert too_big.value.status() == "StatusCode.INVALID_ARGUMENT" and "'big'" in too_big.value.message()
        with pytest.raises(InferenceServerException) as cuda:
            client.register_cuda_shared_memory("gpu", b"aGFuZGxl", 0, 64)  # base64 of a handle
        assert cuda.value.status() == "StatusCode.UNIMPLEMENTED" and "CUDA" in cuda.value.message()
        status = client.get_system_shared_memory_status()
        assert {name: r.byte_size for name, r in status.regions.items()} == {"in": 128}
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)
    assert client.get_system_shared_memory_status().regions == {}


def test_shm_output_region_too_small_is_refused_with_tritons_words(triton_mesh):
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(triton_mesh.address)
    key = f"/bl_test_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("out", key, 32)
    try:
        client.register_system_shared_memory("out", key, 32)
        inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("out", 32)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("simple", inputs, outputs=[output])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "should be at least 64 bytes to hold the results" in refused.value.message()
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


def test_a_decoupled_models_outputs_are_not_classified_or_put_in_shared_memory(triton_mesh):
    import queue

    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    inputs = [grpcclient.InferInput("IN", [2], "INT32"), grpcclient.InferInput("DELAY", [2], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    for tensor, dtype in zip(inputs, (np.int32, np.uint32, np.uint32)):
        tensor.set_data_from_numpy(np.zeros(tensor.shape(), dtype))
    with grpcclient.InferenceServerClient(triton_mesh.address) as client:
        client.start_stream(callback=lambda result, error: got.put(error or result))
        client.async_stream_infer("repeat_int32", inputs,
                                  outputs=[grpcclient.InferRequestedOutput("OUT", class_count=1)])
        client.stop_stream()
    error = got.get_nowait()
    assert "INVALID_ARGUMENT" in str(error) and "'repeat_int32' is decoupled" in str(error)
