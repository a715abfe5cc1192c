"""The live model repository, with real processes and real Redis: a new version rolled out under
load (poll and explicit mode) with no failed request, a model unloaded under load, the repository
index, and loads that cannot succeed."""
from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from batchline import contract
from batchline.protocol import internal_pb2 as pb
from batchline.testing.load import MLP_FEATURES, LoadClient
from batchline.testing.polling import poll
from batchline.testing.processes import ProcessMesh

CLIENTS = 32


@pytest.fixture
def repository(model_repository, tmp_path):
    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "mlp", repo / "mlp", ignore=shutil.ignore_patterns("trt_cache"))
    for extra in [p for p in (repo / "mlp").iterdir() if p.is_dir() and p.name != "1"]:
        shutil.rmtree(extra)
    return repo


def _advertised(mesh: ProcessMesh) -> set[tuple[str, str, bool]]:
    """(model, version, unloading) as the executors advertise them."""
    out = set()
    for name in mesh.executors:
        blob = mesh.probe.redis.get(contract.executor(name))
        if blob:
            out |= {(m.name, m.version, m.unloading) for m in pb.ExecutorInfo.FromString(blob).models}
    return out


def _index(client: tc.InferenceServerClient) -> dict[tuple[str, str], tuple[str, str]]:
    return {(m.name, m.version): (m.state, m.reason) for m in client.get_model_repository_index().models}


def _start(tmp_path, repository, mode: str, *executor_flags: str) -> ProcessMesh:
    mesh = ProcessMesh(repository, tmp_path / "logs", models=())
    mesh.start_redis()
    mesh.add_executor(flags=["--model-control-mode", mode, *executor_flags])
    mesh.add_scheduler()
    mesh.add_gateway(flags=["--model-control-mode", mode])
    mesh.probe.wait_for_executors(1)
    mesh.probe.wait_ready()
    return mesh


def _check_rollout(records, switched_at: float) -> dict[str, int]:
    """Every request answered correctly; none sent after the switch was answered by version 1."""
    failed = [r for r in records if r.code != "OK" or not r.correct]
    assert not failed, f"{len(failed)} of {len(records)} failed during the rollout, e.g. {failed[:3]}"
    late_v1 = [r for r in records if r.version == "1" and r.sent > switched_at + 1.0]
    assert not late_v1, f"{len(late_v1)} requests sent well after version 2 served still went to version 1"
    return {v: sum(1 for r in records if r.version == v) for v in ("1", "2")}


def test_poll_mode_rolls_a_new_version_out_under_load_without_a_failed_request(tmp_path, repository):
    with _start(tmp_path, repository, "poll", "--repository-poll-s", "0.3") as mesh:
        address = mesh.probe.gateway_address()
        with LoadClient(address, repository / "mlp" / "1" / "model.onnx", concurrency=CLIENTS) as load:
            load.wait_ok(200, 0.0, 30)
            copied_at = time.monotonic()
            shutil.copytree(repository / "mlp" / "1", repository / "mlp" / "2")
            # Version 2 is loaded and warmed up, then takes the traffic; version 1 finishes and goes.
            poll(lambda: ("mlp", "2", False) in _advertised(mesh), 60, "version 2 to be served", check=mesh.check_alive)
            switched_at = time.monotonic()
            poll(lambda: {v for _, v, _ in _advertised(mesh)} == {"2"}, 30, "version 1 to be released",
                 check=mesh.check_alive)
            load.wait_ok(200, time.monotonic(), 30)
        records = load.stop()
        counts = _check_rollout(records, switched_at)
        print(f"poll rollout: {len(records)} requests ({counts}), version 2 served "
              f"{switched_at - copied_at:.1f} s after the copy, 0 failed")
        assert counts["1"] > 0 and counts["2"] > 0
        with tc.InferenceServerClient(address) as client:
            index = _index(client)
            assert index[("mlp", "2")] == ("READY", "")
            assert index[("mlp", "1")] == ("UNAVAILABLE", "unloaded")
            assert client.is_model_ready("mlp", "2") and not client.is_model_ready("mlp", "1")
            assert client.get_model_metadata("mlp").versions == ["2"]
            # Poll mode takes no explicit calls, as in Triton.
            with pytest.raises(InferenceServerException, match="explicit model load is not allowed") as refused:
                client.load_model("mlp")
            assert refused.value.status() == "StatusCode.UNAVAILABLE"


def test_explicit_mode_loads_and_unloads_under_load_and_reports_what_cannot_load(tmp_path, repository):
    (repository / "broken" / "1").mkdir(parents=True)
    (repository / "broken" / "1" / "model.onnx").write_bytes(b"this is not an ONNX model")
    with _start(tmp_path, repository, "explicit", "--load-model", "mlp") as mesh, \
            tc.InferenceServerClient(mesh.probe.gateway_address()) as client:
        assert _index(client) == {("mlp", "1"): ("READY", ""), ("broken", ""): ("", "")}
        with LoadClient(mesh.probe.gateway_address(), repository / "mlp" / "1" / "model.onnx",
                        concurrency=CLIENTS) as load:
            load.wait_ok(200, 0.0, 30)

            # Loads that cannot succeed fail with the reason; mlp serves on.
            with pytest.raises(InferenceServerException) as missing:
                client.load_model("nope")
            assert missing.value.status() == "StatusCode.NOT_FOUND" and "'nope'" in missing.value.message()
            with pytest.raises(InferenceServerException) as corrupt:
                client.load_model("broken")
            assert corrupt.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert "ONNX Runtime could not load it" in corrupt.value.message()
            assert "protobuf" in corrupt.value.message().lower()
            assert _index(client)[("broken", "1")][0] == "UNAVAILABLE"

            # A new version: load_model returns once it serves, and the traffic moves to it.
            shutil.copytree(repository / "mlp" / "1", repository / "mlp" / "2")
            client.load_model("mlp")
            switched_at = time.monotonic()
            assert client.is_model_ready("mlp", "2")
            poll(lambda: _index(client).get(("mlp", "1")) == ("UNAVAILABLE", "unloaded"), 30,
                 "version 1 to be released")
            load.wait_ok(200, time.monotonic(), 30)
            rollout = [r for r in load.snapshot()]
            counts = _check_rollout(rollout, switched_at)

            # Unloading the whole model under load: what was queued is answered, then new calls are refused.
            unload_at = time.monotonic()
            client.unload_model("mlp")
            poll(lambda: not _advertised(mesh), 30, "mlp to be released")
            refused_from = load.count("NOT_FOUND")
            poll(lambda: load.count("NOT_FOUND") > refused_from + 20, 30, "calls to the unloaded model to be refused")
        records = load.stop()
        print(f"explicit rollout: {len(rollout)} requests ({counts}), 0 failed; unload: "
              f"{sum(1 for r in records if r.sent >= unload_at and r.code == 'OK')} answered after it began")
        before = [r for r in records if r.sent < unload_at]
        assert all(r.code == "OK" and r.correct for r in before)
        after = [r for r in records if r.sent >= unload_at]
        assert {r.code for r in after} <= {"OK", "NOT_FOUND"}, sorted({(r.code, r.message) for r in after})
        refusals = {r.message for r in after if r.code == "NOT_FOUND"}
        assert refusals and all("'mlp'" in m and "unload" in m for m in refusals), refusals
        assert _index(client)[("mlp", "2")] == ("UNAVAILABLE", "unloaded")
        assert not client.is_model_ready("mlp")
        # ... and loading it again serves it again.
        client.load_model("mlp")
        assert client.is_model_ready("mlp", "2")


def test_an_executor_restarted_in_explicit_mode_serves_what_was_loaded(tmp_path, repository):
    shutil.copytree(repository / "mlp", repository / "other")
    with _start(tmp_path, repository, "explicit", "--load-model", "mlp") as mesh, \
            tc.InferenceServerClient(mesh.probe.gateway_address()) as client:
        client.load_model("other")
        client.unload_model("mlp")
        poll(lambda: {m for m, _, _ in _advertised(mesh)} == {"other"}, 30, "mlp to be released")
        [name] = mesh.executors
        mesh.restart(name)
        mesh.probe.wait_for_executors(1, names=[name])
        # The calls made since start win over its --load-model.
        assert {m for m, _, _ in _advertised(mesh)} == {"other"}
        features = tc.InferInput("features", [1, MLP_FEATURES], "FP32")
        features.set_data_from_numpy(np.zeros((1, MLP_FEATURES), np.float32))
        with pytest.raises(InferenceServerException, match="unloaded"):
            client.infer("mlp", [features])


def test_batchline_up_in_explicit_mode_starts_empty_and_loads_on_request(repository):
    from batchline.testing.up import STARTUP_S, Up

    up = Up("--model-repository", str(repository), "--model-control-mode", "explicit",
            "--gateway-port", "0", "--metrics-port", "-1", "--http-port", "-1")
    try:
        address = up.wait_for(r"listening on (\S+);", STARTUP_S).group(1)
        with tc.InferenceServerClient(address) as client:
            assert _index(client) == {("mlp", ""): ("", "")}
            assert not client.is_model_ready("mlp")
            client.load_model("mlp")
            features = tc.InferInput("features", [2, MLP_FEATURES], "FP32")
            features.set_data_from_numpy(np.ones((2, MLP_FEATURES), np.float32))
            assert client.infer("mlp", [features]).as_numpy("probability").shape == (2, 1)
    finally:
        assert up.stop() == 0, up.output


def test_version_policy_selects_versions_and_refuses_what_is_not_one():
    from executor.model_config import ConfigError, ModelConfig, select_versions

    present = ["3", "1", "10", "2", "tmp"]
    assert select_versions({"latest": 1}, present) == ["10"]
    assert select_versions({"latest": 2}, present) == ["3", "10"]
    assert select_versions({"all": True}, present) == ["1", "2", "3", "10"]
    assert select_versions({"specific": [2, 7]}, present) == ["2"]
    assert ModelConfig().version_policy == {"latest": 1}
    for bad, named in (({"latest": 0}, "latest"), ({"all": False}, "all"), ({"specific": []}, "specific"),
                       ({"newest": 1}, "one of"), ({"latest": 1, "all": True}, "one of")):
        with pytest.raises(Exception, match=named):
            ModelConfig(version_policy=bad)
    assert issubclass(ConfigError, ValueError)


def test_load_model_flags_repeat_and_list():
    from batchline.settings import parse_settings
    from executor.settings import ExecutorSettings

    settings = parse_settings(ExecutorSettings, ["--load-model", "a", "--load-model", "b", "c",
                                                 "--model-control-mode", "explicit"], "executor", "")
    assert settings.load_model == ["a", "b", "c"] and settings.model_control_mode == "explicit"


def test_a_version_or_a_folder_that_cannot_be_read_fails_alone_at_start(repository):
    """Poll mode's start: a version ONNX Runtime cannot load leaves the model's next version
    serving; a folder that cannot be read (its config.toml a directory here, as lost+found is for
    a non-root executor) and a version named with a non-ASCII digit fail alone."""
    import asyncio
    import types

    from executor.live import LiveRepository
    from executor.settings import ExecutorSettings

    mlp = repository / "mlp"
    (mlp / "config.toml").write_text("version_policy = { all = true }\n" + (mlp / "config.toml").read_text())
    shutil.copytree(mlp / "1", mlp / "2")
    shutil.copytree(mlp / "1", mlp / "\u00b2")           # '²'.isdigit(), but no int()
    (mlp / "1" / "model.onnx").write_bytes(b"not a graph")
    (repository / "unreadable" / "config.toml").mkdir(parents=True)

    settings = ExecutorSettings(model_repository=str(repository), model_control_mode="poll")
    live = LiveRepository(types.SimpleNamespace(settings=settings))  # initial() reads only the settings
    models = asyncio.run(live.initial())
    assert [(m.name, m.version) for m in models] == [("mlp", "2")]
    entries = {(e.name, e.version): (e.state, e.reason) for e in live.entries()}
    assert entries[("mlp", "2")][0] == "READY"
    assert entries[("mlp", "1")][0] == "UNAVAILABLE" and "ONNX Runtime" in entries[("mlp", "1")][1]
    assert entries[("unreadable", "")][0] == "UNAVAILABLE"
    assert "cannot be read" in entries[("unreadable", "")][1]


def test_an_explicit_load_tries_again_a_reload_that_failed(repository, monkeypatch):
    """A reload that failed for a passing reason (out of GPU memory while the old session held it),
    the old files serving on: the next explicit load tries it again instead of answering that the
    model is loaded; poll mode waits for the files to change."""
    import asyncio
    import types

    import executor.live as live_module
    from executor.live import LiveRepository
    from executor.settings import ExecutorSettings

    placed: list = []

    async def place(model) -> None:
        placed.append(model)

    async def nothing(*_) -> None:
        pass

    def app(mode: str):
        settings = ExecutorSettings(model_repository=str(repository), model_control_mode=mode, warmup=False)
        return types.SimpleNamespace(settings=settings, place=place, announce=nothing, mark_unloading=nothing)

    real_load = live_module.load_model
    failing = {"once": False}

    def load_model(*args, **kwargs):
        if failing["once"]:
            failing["once"] = False
            raise RuntimeError("CUDA out of memory (passing)")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(live_module, "load_model", load_model)
    onnx_file = repository / "mlp" / "1" / "model.onnx"
    for mode, retried in (("explicit", True), ("poll", False)):
        placed.clear()
        live = LiveRepository(app(mode))  # type: ignore[arg-type]
        asyncio.run(live.sync("mlp"))
        assert len(placed) == 1 and live.slots[("mlp", "1")].state == "READY"
        onnx_file.write_bytes(onnx_file.read_bytes())  # new files (a new time), the same graph
        failing["once"] = True
        asyncio.run(live.sync("mlp"))
        assert len(placed) == 1 and live.slots[("mlp", "1")].reason.startswith("a reload failed")
        asyncio.run(live.sync("mlp"))  # the load called again, its files unchanged
        assert len(placed) == (2 if retried else 1), mode
        assert live.slots[("mlp", "1")].reason.startswith("a reload failed") != retried


def test_poll_mode_announces_a_version_unloading_when_it_marks_it(repository):
    """A version a poll takes out of service is advertised as unloading at once: its release's
    grace counts from the mark, and a heartbeat as late as its interval would leave the gateways
    sending to it into that grace."""
    import asyncio
    import types

    from executor.live import LiveRepository
    from executor.settings import ExecutorSettings

    events: list[str] = []

    async def place(model) -> None:
        events.append(f"place {model.version}")

    async def announce() -> None:
        events.append("announce")

    async def check() -> None:
        settings = ExecutorSettings(model_repository=str(repository), model_control_mode="poll", warmup=False)
        app = types.SimpleNamespace(settings=settings, place=place, announce=announce,
                                    mark_unloading=lambda key, on=True: events.append(f"unloading {key[1]}"))
        live = LiveRepository(app)  # type: ignore[arg-type]
        await live.sync("mlp")
        shutil.copytree(repository / "mlp" / "1", repository / "mlp" / "2")  # the newest version: 1 goes
        await live.sync("mlp")

    asyncio.run(check())
    assert events[-2:] == ["unloading 1", "announce"], events


def test_a_file_beside_the_graph_is_part_of_the_version_and_a_vanished_config_keeps_it(repository):
    """A version's other files (external weights, labels) changing is a new version; its
    config.toml gone for a moment (a tool that unlinks before it writes) is not a version with
    every default, and what serves stays."""
    import asyncio
    import types

    from executor.live import LiveRepository
    from executor.settings import ExecutorSettings

    placed: list = []

    async def place(model) -> None:
        placed.append(model)

    async def nothing(*_) -> None:
        pass

    settings = ExecutorSettings(model_repository=str(repository), model_control_mode="poll", warmup=False)
    live = LiveRepository(types.SimpleNamespace(settings=settings, place=place, announce=nothing,  # type: ignore
                                                mark_unloading=lambda *_: None))
    config = repository / "mlp" / "config.toml"
    asyncio.run(live.sync("mlp"))
    assert len(placed) == 1
    (repository / "mlp" / "1" / "labels.txt").write_text("no\nyes\n")
    asyncio.run(live.sync("mlp"))
    assert len(placed) == 2  # reloaded: a file of the version changed
    text = config.read_text()
    config.unlink()
    asyncio.run(live.sync("mlp"))
    assert len(placed) == 2 and live.slots[("mlp", "1")].state == "READY"
    assert placed[-1].info.max_batch_size == 64  # as config.toml says, not the default
    config.write_text(text)
    asyncio.run(live.sync("mlp"))
    assert live.slots[("mlp", "1")].state == "READY" and placed[-1].info.max_batch_size == 64


def test_a_provider_that_falls_back_in_the_warm_up_is_what_the_model_shows(repository):
    """ONNX Runtime falls back when a provider fails in a run (TensorRT's engine build, on the
    first run): the model's providers, which the status, the provider gauge and the profiles'
    kind read, follow where it runs. No GPU here: the session is a real CPU one, told that it
    was loaded for TensorRT first."""
    from executor.repository import load_model, read_config
    from executor.warmup import warm_up

    mlp = repository / "mlp"
    model = load_model(mlp, mlp / "1", read_config(mlp), ["CPUExecutionProvider"], "", 1)
    model.info.providers.insert(0, "TensorrtExecutionProvider")  # as loaded, before the first run failed
    reports = warm_up(model, "e")
    assert list(model.info.providers) == ["CPUExecutionProvider"] and reports
