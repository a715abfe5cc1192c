"""Execution providers on a real GPU: a mesh serving a model on CUDA, its answers against the CPU's,
`batchline optimize` choosing FP16, and TensorRT asked for without its libraries. These are marked
`gpu` and skip, with the reason, where ONNX Runtime offers no CUDAExecutionProvider or no CUDA device
works. The parts that need no GPU (the reasons, the CPU's provider) run everywhere.

    python -m pytest -m gpu tests/e2e/test_gpu.py
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import pathlib
import subprocess
import sys
import urllib.request

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from batchline.testing.checkout import ROOT
from batchline.testing.processes import ProcessMesh
from executor import providers as gpu
from executor.repository import load_repository
from executor.sessions import create_session
from executor.settings import DEFAULT_PROVIDERS

OPSET = 17
MESH_MODEL = "mlp16"  # small: what the mesh serves
WIDE_MODEL = "wide"   # big MatMuls: what FP16 must be faster on
WIDE_BATCH = 1024


def _mlp(name: str, widths: list[int], seed: int = 0) -> onnx.ModelProto:
    """x FP32 [batch, widths[0]] -> MatMul, Tanh, ..., MatMul -> y FP32 [batch, widths[-1]]. Weights
    scaled by 1/sqrt(fan-in), so every layer's values stay near 1 (FP16 keeps them to ~1e-3)."""
    rng = np.random.default_rng(seed)
    nodes, weights, current = [], [], "x"
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        w = (rng.standard_normal((fan_in, fan_out), dtype=np.float32) * (1.5 / np.sqrt(fan_in))).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"w{i}"))
        last = i == len(widths) - 2
        nodes.append(oh.make_node("MatMul", [current, f"w{i}"], ["y" if last else f"h{i}"]))
        if not last:
            nodes.append(oh.make_node("Tanh", [f"h{i}"], [f"a{i}"]))
            current = f"a{i}"
    graph = oh.make_graph(nodes, name, [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", widths[0]])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", widths[-1]])], weights)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def _save(repo: pathlib.Path, name: str, model: onnx.ModelProto, config: str) -> pathlib.Path:
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / name / "config.toml").write_text(config)
    return repo / name / "1" / "model.onnx"


# ---------------------------------------------------------------- on any host

def test_why_tensorrt_is_unavailable_names_its_missing_library():
    if not gpu.unloadable(["libnvinfer.so.10"]):
        pytest.skip("TensorRT's libnvinfer.so.10 loads on this host")
    why = gpu.why_unavailable(gpu.TENSORRT)
    assert "libnvinfer.so.10 cannot be loaded (libnvinfer.so.10: cannot open shared object file" in why
    if gpu.TENSORRT not in ort.get_available_providers():
        package, version, _ = gpu.build()
        assert why.startswith(f"{package} {version} is built without it (onnxruntime-gpu has it); ")
    # As a GPU build without TensorRT's libraries sees it: the libraries are the reason, not the build.
    offered = gpu.why_unavailable(gpu.TENSORRT, [gpu.TENSORRT, gpu.CUDA, gpu.CPU])
    assert offered.startswith("libnvinfer.so.10 cannot be loaded")


def test_a_provider_listed_without_its_libraries_is_not_usable():
    # No host that runs this suite has TensorRT's libraries (a GPU host's onnxruntime-gpu lists it all
    # the same): what optimize and the executor may count on is the CPU.
    assert gpu.unloadable(["libnvinfer.so.10"])
    assert gpu.usable([gpu.TENSORRT, gpu.CPU]) == [gpu.CPU]


def test_the_libraries_looked_for_follow_the_cuda_version_onnx_runtime_was_built_with():
    assert gpu.libraries(gpu.CUDA, "13.0") == ["libcuda.so.1", "libcudart.so.13", "libcublasLt.so.13",
                                              "libcublas.so.13", "libcurand.so.10", "libcudnn.so.9"]
    assert gpu.libraries(gpu.TENSORRT, "12.8") == ["libnvinfer.so.10", "libnvonnxparser.so.10", "libcudart.so.12",
                                                   "libcublas.so.12", "libcudnn.so.9"]
    assert gpu.libraries(gpu.CUDA, "") == ["libcuda.so.1", "libcurand.so.10", "libcudnn.so.9"]
    assert gpu.libraries(gpu.CPU, "13.0") == []
    # A library this process can load is not a reason.
    assert gpu.unloadable(["libc.so.6", "libnot-a-library.so.7"]) == [
        ("libnot-a-library.so.7", "libnot-a-library.so.7: cannot open shared object file: No such file or directory")]


def test_the_warning_names_what_it_fell_back_from_what_it_runs_on_and_why():
    offered = [gpu.TENSORRT, gpu.CUDA, gpu.CPU]
    warning = gpu.fallback_warning("m version 3", offered, [gpu.CUDA, gpu.CPU], offered,
                                   {gpu.TENSORRT: "RegisterTensorRTPluginsAsCustomOps: Please install TensorRT"})
    assert warning.startswith("m version 3 runs on CUDAExecutionProvider, not TensorrtExecutionProvider, ")
    assert gpu.why_unavailable(gpu.TENSORRT, offered) in warning
    assert warning.endswith("creating the session with it failed: RegisterTensorRTPluginsAsCustomOps: Please install "
                            "TensorRT")
    both = gpu.fallback_warning("m version 3", offered, [gpu.CPU], offered)
    assert both.startswith("m version 3 runs on CPUExecutionProvider, not TensorrtExecutionProvider nor "
                           "CUDAExecutionProvider, ")
    assert f"CUDAExecutionProvider: {gpu.why_unavailable(gpu.CUDA, offered)}" in both
    # Running on the first provider offered, or on the CPU when no GPU provider is offered: nothing to say.
    assert gpu.fallback_warning("m", offered, [gpu.TENSORRT, gpu.CUDA, gpu.CPU], offered) is None
    assert gpu.fallback_warning("m", offered, [gpu.CPU], [gpu.CPU]) is None


def test_the_gpu_scripts_mesh_steps_read_streams_and_rows_and_name_a_bad_step():
    bench = ROOT / "benchmarks"
    parsed = subprocess.run([sys.executable, "-c", "import gpu; print(gpu.parse_steps('1x1, 8x4s/4,8x6/2'))"],
                            cwd=bench, capture_output=True, text=True, timeout=60)
    assert parsed.stdout.strip() == "[(1, 1, False, 1), (8, 4, True, 4), (8, 6, False, 2)]", parsed.stderr
    for bad in ("8x4s/0", "8x4/x", "8x", "4x2,4x1"):
        out = subprocess.run([sys.executable, "gpu.py", "--mesh-steps", bad], cwd=bench, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode != 0 and "--mesh-steps" in out.stderr and bad.split(",")[0] in out.stderr, out.stderr


def test_a_cpu_host_serves_on_the_cpu_and_warns_of_nothing(tmp_path, caplog):
    if set(gpu.GPU) & set(ort.get_available_providers()):
        pytest.skip("this ONNX Runtime offers a GPU provider")
    _save(tmp_path, MESH_MODEL, _mlp(MESH_MODEL, [64, 256, 16]), "max_batch_size = 8\n")
    with caplog.at_level(logging.WARNING):
        (model,) = load_repository(tmp_path, providers=DEFAULT_PROVIDERS)
        session = create_session(tmp_path / MESH_MODEL / "1" / "model.onnx",
                                 [(gpu.TENSORRT, {"trt_fp16_enable": True}), (gpu.CPU, {})], 1)
    assert list(model.info.providers) == [gpu.CPU] and session.get_providers() == [gpu.CPU]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert not gpu._preloaded, "no GPU provider was asked for that this build offers: nothing to preload"


# ---------------------------------------------------------------- on a GPU

def _cuda_problem() -> str | None:
    """Why CUDA cannot run a model here, or None: a session on a one-node model must run on it."""
    available = ort.get_available_providers()
    if gpu.CUDA not in available:
        return f"ONNX Runtime offers no {gpu.CUDA} here (it offers {', '.join(available)})"
    gpu.preload_cuda_libraries()
    graph = oh.make_graph([oh.make_node("Add", ["a", "a"], ["b"])], "probe",
                          [oh.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", OPSET)])
    model.ir_version = 8
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=[gpu.CUDA, gpu.CPU])
    except Exception as exc:  # noqa: BLE001 - e.g. no CUDA device
        return f"a session on {gpu.CUDA} failed: {exc}"
    if session.get_providers()[0] != gpu.CUDA:
        return f"a session asked for {gpu.CUDA} runs on {session.get_providers()[0]}: {gpu.why_unavailable(gpu.CUDA)}"
    return None


@pytest.fixture(scope="session")
def cuda() -> None:
    problem = _cuda_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture(scope="module")
def gpu_mesh(cuda, tmp_path_factory):
    """Redis, one executor with the default providers (TensorRT, CUDA, CPU), a scheduler and a
    gateway, each its own process, serving a small MLP."""
    repo = tmp_path_factory.mktemp("gpu-repo")
    _save(repo, MESH_MODEL, _mlp(MESH_MODEL, [64, 256, 16]), "max_batch_size = 8\nmax_queue_delay_ms = 20\n")
    with ProcessMesh(repo, tmp_path_factory.mktemp("gpu-logs"), models=[MESH_MODEL]) as mesh:
        mesh.start(timeout=60)
        yield mesh


def _infer(address: str, x: np.ndarray) -> np.ndarray:
    import tritonclient.grpc as tc

    with tc.InferenceServerClient(address) as client:
        inp = tc.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(MESH_MODEL, [inp], client_timeout=30).as_numpy("y")


@pytest.mark.gpu
def test_the_executor_serves_on_cuda_and_says_so(gpu_mesh):
    import tritonclient.grpc as tc

    address = gpu_mesh.probe.gateway_address()
    x = np.random.default_rng(1).standard_normal((3, 64), dtype=np.float32)
    assert _infer(address, x).shape == (3, 16)
    out = subprocess.run([sys.executable, "-m", "batchline.cli", "status", "--redis-url", gpu_mesh.redis_url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [executor] = json.loads(out.stdout)["executors"]
    assert [(m["name"], m["provider"]) for m in executor["models"]] == [(MESH_MODEL, gpu.CUDA)]
    with tc.InferenceServerClient(address) as client:
        config = client.get_model_config(MESH_MODEL).config
    assert config.parameters["providers"].string_value.split(",")[0] == gpu.CUDA
    assert _provider_metrics(gpu_mesh) == {(MESH_MODEL, gpu.CUDA)}


def _provider_metrics(mesh: ProcessMesh) -> set[tuple[str, str]]:
    """(model, provider) of every batchline_model_provider sample at 1 on the executor's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    [name] = mesh.executors
    for port in mesh.probe.listening_ports(name):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except (OSError, ValueError, http.client.HTTPException):
            continue  # the gRPC port
        return {(s.labels["model"], s.labels["provider"]) for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "batchline_model_provider" and s.value == 1}
    raise AssertionError(f"no /metrics among {name}'s ports {mesh.probe.listening_ports(name)}")


@pytest.mark.gpu
def test_a_batch_answered_on_cuda_matches_the_cpu(gpu_mesh):
    path = pathlib.Path(gpu_mesh.repo) / MESH_MODEL / "1" / "model.onnx"
    cpu = ort.InferenceSession(str(path), providers=[gpu.CPU])
    rng = np.random.default_rng(2)
    requests = [rng.standard_normal((rows, 64), dtype=np.float32) for rows in (1, 2, 3, 1, 1)]  # 8 rows: a full batch
    address = gpu_mesh.probe.gateway_address()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda x: _infer(address, x), requests))
    for x, y in zip(requests, answers):
        expected = cpu.run(["y"], {"x": x})[0]
        assert not np.array_equal(y, np.zeros_like(y))
        # CUDA's FP32 MatMuls may round their inputs to TF32 (FP16's 10-bit mantissa).
        np.testing.assert_allclose(y, expected, rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
def test_tensorrt_without_its_libraries_serves_on_cuda_and_the_log_says_why(gpu_mesh):
    if gpu.TENSORRT not in ort.get_available_providers():
        pytest.skip(f"this ONNX Runtime offers no {gpu.TENSORRT}")
    if not gpu.unloadable(["libnvinfer.so.10"]):
        pytest.skip("TensorRT's libnvinfer.so.10 loads here: the executor serves on TensorRT")
    address = gpu_mesh.probe.gateway_address()
    assert _infer(address, np.ones((1, 64), np.float32)).shape == (1, 16)
    [name] = gpu_mesh.executors
    log = pathlib.Path(gpu_mesh.services[name].log_path).read_text(errors="replace")
    lines = [line for line in log.splitlines() if f"{MESH_MODEL} version 1 runs on" in line]
    assert len(lines) == 1, gpu_mesh.logs()
    assert " WARNING executor.sessions: " in lines[0]
    assert f"{MESH_MODEL} version 1 runs on {gpu.CUDA}, not {gpu.TENSORRT}, " in lines[0]
    assert f"{gpu.TENSORRT}: libnvinfer.so.10 cannot be loaded (libnvinfer.so.10: cannot open shared object" in lines[0]


@pytest.mark.gpu
def test_optimize_writes_the_fp16_version_where_it_is_faster_on_the_gpu(cuda, tmp_path):
    # 4096-wide MatMuls on 1024 rows: the GPU is busy, and FP16 halves both its weights' bytes and
    # its tensor-core time against FP32 (or TF32).
    _save(tmp_path, WIDE_MODEL, _mlp(WIDE_MODEL, [256, 4096, 4096, 4096, 4096, 256]),
          f"max_batch_size = {WIDE_BATCH}\n")
    out = subprocess.run([sys.executable, "-m", "batchline.cli", "optimize", WIDE_MODEL, "--repository", str(tmp_path),
                          "--variants", "fp16", "--scratch", str(tmp_path / "scratch")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    written = tmp_path / WIDE_MODEL / "2"
    assert sorted(p.name for p in written.iterdir()) == ["model.onnx", "optimize.json"], out.stdout
    report = json.loads((written / "optimize.json").read_text())
    assert (report["chosen"], report["written_version"], report["source_version"]) == ("fp16", "2", "1")
    assert report["serves_on"] in gpu.GPU
    [fp16] = report["variants"]
    assert (fp16["name"], fp16["provider"], fp16["choosable"], fp16["gate"]["passed"]) == ("fp16", gpu.CUDA, True, True)
    assert fp16["speed"][str(WIDE_BATCH)]["throughput_ratio"] >= 1.05
    weights = onnx.load(str(written / "model.onnx")).graph.initializer
    assert {w.data_type for w in weights} == {TensorProto.FLOAT16}
    # The version written serves on CUDA, as an executor with the default providers loads it.
    (latest,) = load_repository(tmp_path, providers=[gpu.CUDA, gpu.CPU])
    assert (latest.version, latest.info.providers[0]) == ("2", gpu.CUDA)
