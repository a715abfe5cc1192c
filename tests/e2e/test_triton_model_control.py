"""Triton's simple_grpc_model_control.py (tests/triton_examples, unmodified) against a mesh in
explicit model control mode, and load_model's `config=` and `files=` overrides: what they load,
how they fail, and that their files reach the executor through Redis and expire there."""
from __future__ import annotations

import subprocess
import sys

import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from batchline import contract
from batchline.embedded_redis import free_port
from batchline.testing import triton_models
from batchline.testing.processes import ProcessMesh, poll
from batchline.testing.checkout import TRITON_EXAMPLES as EXAMPLES


@pytest.fixture
def explicit_mesh(tmp_path):
    repo = triton_models.build_repository(tmp_path / "repository")
    # Stopped however the start goes: a gateway that fails to start must not leave the others running.
    with ProcessMesh(repo, tmp_path / "logs", models=()) as mesh:
        mesh.start_redis()
        mesh.add_executor(flags=["--model-control-mode", "explicit", "--load-model", "simple"])
        mesh.add_scheduler()
        # A small cap on a load's files, to see it refused past it.
        mesh.add_gateway(flags=["--model-control-mode", "explicit", "--load-files-max-bytes", "100000",
                                "--http-port", "-1"])
        mesh.probe.wait_for_executors(1)
        mesh.probe.wait_ready()
        yield mesh


def test_simple_grpc_model_control(explicit_mesh):
    done = subprocess.run([sys.executable, str(EXAMPLES / "simple_grpc_model_control.py"), "-u",
                           explicit_mesh.probe.gateway_address()], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "PASS: model control" in done.stdout, done.stdout + done.stderr


def test_a_model_loaded_from_files_serves_and_its_override_expires_in_redis(explicit_mesh, tmp_path):
    client = tc.InferenceServerClient(explicit_mesh.probe.gateway_address())
    onnx_bytes = (tmp_path / "repository" / "simple_int8" / "1" / "model.onnx").read_bytes()
    # A model the repository does not hold, from its files alone, under Triton's JSON config.
    config = '{"max_batch_size": 4, "input": [{"name": "INPUT0", "format": "FORMAT_NONE"}]}'
    client.load_model("from_files", config=config, files={"file:1/model.onnx": onnx_bytes})
    assert client.is_model_ready("from_files")
    assert client.get_model_config("from_files").config.max_batch_size == 4
    ttl = explicit_mesh.probe.redis.ttl(contract.keys.override("from_files"))
    assert 0 < ttl <= contract.keys.CONTROL_TTL

    # An executor that starts again loads what the calls asked for, the override's files included.
    [executor] = explicit_mesh.executors
    explicit_mesh.kill(executor)
    explicit_mesh.probe.wait_executor_gone(executor)
    poll(lambda: not client.is_model_ready("from_files"), 10, "the gateway to see the executor gone")
    explicit_mesh.restart(executor)
    poll(lambda: client.is_model_ready("from_files") and client.is_model_ready("simple"), 60,
         "the restarted executor to serve from_files again", check=explicit_mesh.check_alive)
    assert client.get_model_config("from_files").config.max_batch_size == 4

    # A config batchline cannot serve fails with the field named; what serves goes on.
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("from_files", config='{"sequence_batching": {}}')
    assert "failed to load" in refused.value.message() and "sequence_batching" in refused.value.message()
    assert client.is_model_ready("from_files")

    # Past the gateway's cap: RESOURCE_EXHAUSTED, naming the setting.
    with pytest.raises(InferenceServerException) as too_big:
        client.load_model("other", config="{}", files={"file:1/model.onnx": b"x" * 200_000})
    assert too_big.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "load_files_max_bytes" in too_big.value.message()

    # Files without a config, and a path out of the model's directory, are refused at the door.
    with pytest.raises(InferenceServerException) as no_config:
        client.load_model("other", files={"file:1/model.onnx": onnx_bytes})
    assert no_config.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as escape:
        client.load_model("other", config="{}", files={"file:../model.onnx": onnx_bytes})
    assert "failed to poll from model repository" in escape.value.message()
    # Paths where one is a file and the other needs it to be a folder: refused before any executor
    # tries to write them.
    with pytest.raises(InferenceServerException) as clash:
        client.load_model("other", config="{}", files={"file:1": onnx_bytes, "file:1/model.onnx": onnx_bytes})
    assert "'file:1' names a file where another parameter's path needs a folder" in clash.value.message()

    # A name that walks out of the repository (into another model's directory) is no model's
    # name: refused at the door, on load and unload, with nothing written for the executors.
    for call in (lambda n: client.load_model(n, config="{}", files={"file:1/model.onnx": onnx_bytes}),
                 client.load_model, client.unload_model):
        for name in ("x/../simple", "..", "simple\\..\\x"):
            with pytest.raises(InferenceServerException) as outside:
                call(name)
            assert outside.value.status() == "StatusCode.INVALID_ARGUMENT", (name, outside.value)
            assert "one directory of the repository" in outside.value.message()
    controlled = {n.decode() for n in explicit_mesh.probe.redis.hkeys(contract.keys.CONTROL)}
    assert controlled <= {"simple", "from_files", "other"}, controlled

    # Unloading drops the override from Redis.
    client.unload_model("from_files")
    assert not explicit_mesh.probe.redis.exists(contract.keys.override("from_files"))


def test_simple_http_model_control(tmp_path):
    # Triton's HTTP example counts seven models in the repository (its gRPC twin eight).
    names = [n for n in triton_models.NAMES if n != triton_models.IMAGE_MODEL]
    assert len(names) == 7 and "simple" in names
    repo = triton_models.build_repository(tmp_path / "repository", names)
    http_port = free_port()
    with ProcessMesh(repo, tmp_path / "logs", models=()) as mesh:
        mesh.start_redis()
        mesh.add_executor(flags=["--model-control-mode", "explicit", "--load-model", "simple"])
        mesh.add_scheduler()
        mesh.add_gateway(flags=["--model-control-mode", "explicit", "--http-port", str(http_port)])
        mesh.probe.wait_for_executors(1)
        mesh.probe.wait_ready()
        done = subprocess.run([sys.executable, str(EXAMPLES / "simple_http_model_control.py"), "-u",
                               f"127.0.0.1:{http_port}"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "PASS: model control" in done.stdout, done.stdout + done.stderr
