"""Model control of a generative model (explicit mode, in process with real Redis, gRPC and ONNX
Runtime): load_model builds its engine, unload_model lets its running sequences finish and then
frees its cache, a version released while it still generates ends its sequences UNAVAILABLE, and
a reload leaves a running stream on the engine it started on (docs/design/generation.md#model-control)."""
from __future__ import annotations

import threading
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from batchline.testing.decoder import build_gpt
from batchline.testing.polling import poll

FINAL = "triton_final_response"
KEY = ("gpt", "1")
LONG = {"max_tokens": 240, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    build_gpt(root)
    return root


def explicit_mesh(repo, drain_timeout_s: float):
    from batchline.testing.in_process import InProcessMesh

    return InProcessMesh(None, str(repo), executor_overrides={"model_control_mode": "explicit",
                                                              "drain_timeout_s": drain_timeout_s},
                         gateway_overrides={"model_control_mode": "explicit"})


def text_input(prompt: str):
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return [tensor]


class Stream:
    """One generation stream on a client of its own: its responses and its error, as they come."""

    def __init__(self, address: str, prompt: str, parameters: dict) -> None:
        self.results: list = []
        self.errors: list[InferenceServerException] = []
        self.first = threading.Event()
        self.client = grpcclient.InferenceServerClient(address)
        self.client.start_stream(callback=partial(Stream._on, self))
        self.client.async_stream_infer("gpt", text_input(prompt), request_id="s", parameters=parameters)

    def _on(self, result, error) -> None:
        if error is not None:
            self.errors.append(error)
        else:
            self.results.append(result)
        self.first.set()

    @property
    def ended(self) -> bool:
        return bool(self.errors) or bool(self.results) and \
            self.results[-1].get_response().parameters[FINAL].bool_param

    def tokens(self) -> list[int]:
        return [t for r in self.results for t in r.as_numpy("token_ids").tolist()]

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def index(client) -> dict[tuple[str, str], tuple[str, str]]:
    return {(m.name, m.version): (m.state, m.reason) for m in client.get_model_repository_index().models}


def greedy_tokens(client, prompt: str, parameters: dict) -> list[int]:
    return client.infer("gpt", text_input(prompt), parameters=parameters).as_numpy("token_ids").tolist()


def freed(model) -> bool:
    """Its loop stopped, no batch of it runs, and its cache arrays are gone."""
    return model.active == 0 and not model.engine.cache.arrays


def test_load_unload_and_load_again_in_explicit_mode(repo):
    with explicit_mesh(repo, drain_timeout_s=60) as mesh, grpcclient.InferenceServerClient(mesh.address) as client:
        app = mesh.executors[0]
        assert index(client) == {("gpt", ""): ("", "")} and not app.generators
        assert not client.is_model_ready("gpt")

        client.load_model("gpt")
        assert client.is_model_ready("gpt", "1") and index(client) == {KEY: ("READY", "")}
        [model] = app.generators
        want = greedy_tokens(client, "def main(", LONG)
        assert len(want) == 240

        # Unloaded while a stream runs: it finishes (within the drain timeout), then the engine goes.
        stream = Stream(mesh.address, "def main(", LONG)
        try:
            assert stream.first.wait(30) and not stream.errors, stream.errors
            client.unload_model("gpt")
            poll(lambda: stream.ended, 60, "the running stream to end")
            assert not stream.errors and stream.tokens() == want
        finally:
            stream.close()
        poll(lambda: index(client) == {KEY: ("UNAVAILABLE", "unloaded")}, 30, "gpt to be released")
        poll(lambda: freed(model), 10, "the released engine to free its cache")
        assert not app.generators and not client.is_model_ready("gpt")
        with pytest.raises(InferenceServerException, match="'gpt' is unloaded") as refused:
            greedy_tokens(client, "def main(", LONG)
        assert refused.value.status() == "StatusCode.NOT_FOUND"

        client.load_model("gpt")
        assert client.is_model_ready("gpt", "1")
        [again] = app.generators
        assert again is not model
        assert greedy_tokens(client, "def main(", LONG) == want


def test_a_version_released_while_it_generates_ends_its_sequences_unavailable(repo):
    # drain_timeout_s 0: the release the live repository makes after the unload grace ends what
    # still generates at once. The release is made here directly, while the stream is known to run.
    with explicit_mesh(repo, drain_timeout_s=0) as mesh:
        app = mesh.executors[0]
        with grpcclient.InferenceServerClient(mesh.address) as client:
            client.load_model("gpt")
        [model] = app.generators
        stream = Stream(mesh.address, "The", LONG)
        try:
            assert stream.first.wait(30) and not stream.errors, stream.errors

            async def release() -> None:
                app.mark_unloading(KEY)
                app.release(KEY)

            mesh.call(release())
            poll(lambda: stream.ended, 30, "the stream to be ended")
        finally:
            stream.close()
        [error] = stream.errors
        # A stream's error carries its status in its message (tritonclient gives a stream error no status).
        assert error.message().startswith("[UNAVAILABLE] "), error.message()
        assert "'gpt' version 1 was unloaded from executor" in error.message() and "send the rest again" in \
            error.message()
        assert 0 < len(stream.tokens()) < 240
        poll(lambda: freed(model), 10, "the released engine to free its cache")
        assert not model.engine.running and not app.generators


def test_a_reload_leaves_a_running_stream_on_its_engine(repo):
    from executor.generation_serving import load_generation

    with explicit_mesh(repo, drain_timeout_s=60) as mesh, grpcclient.InferenceServerClient(mesh.address) as client:
        app = mesh.executors[0]
        client.load_model("gpt")
        [old] = app.generators
        want = greedy_tokens(client, "import", LONG)

        # Through the repository: a changed config.toml and a load call swap the engine.
        config = repo / "gpt" / "config.toml"
        original = config.read_text()
        try:
            config.write_text(original + "# reloaded\n")
            client.load_model("gpt")
        finally:
            config.write_text(original)
        [reloaded] = app.generators
        assert reloaded is not old and client.is_model_ready("gpt", "1")
        poll(lambda: freed(old), 10, "the replaced engine to free its cache")
        assert greedy_tokens(client, "import", LONG) == want

        # A swap while a stream runs (made directly, so that the stream is known to run across it):
        # the stream ends on its engine, complete; new requests go to the new one.
        new = load_generation(repo / "gpt", "1", app.settings)
        stream = Stream(mesh.address, "import", LONG)
        try:
            assert stream.first.wait(30) and not stream.errors, stream.errors
            mesh.call(app.place(new))
            assert reloaded.active == 1, "the stream runs on the replaced engine"
            assert greedy_tokens(client, "import", {**LONG, "max_tokens": 8}) == want[:8]
            poll(lambda: stream.ended, 60, "the running stream to end")
        finally:
            stream.close()
        assert not stream.errors and stream.tokens() == want
        poll(lambda: freed(reloaded), 10, "the replaced engine to free its cache")
        assert app.generators == [new] and new.active == 0


def test_poll_mode_rolls_a_new_version_of_gpt_out(tmp_path, repo):
    import shutil

    from batchline.testing.in_process import InProcessMesh

    root = tmp_path / "polled"
    shutil.copytree(repo / "gpt", root / "gpt")
    with InProcessMesh(None, str(root), executor_overrides={"model_control_mode": "poll", "repository_poll_s": 0.3},
                       gateway_overrides={"model_control_mode": "poll"}) as mesh, \
            grpcclient.InferenceServerClient(mesh.address) as client:
        app = mesh.executors[0]
        [first] = app.generators
        want = greedy_tokens(client, "import", {**LONG, "max_tokens": 12})
        shutil.copytree(root / "gpt" / "1", root / "gpt" / "2")
        poll(lambda: index(client) == {("gpt", "1"): ("UNAVAILABLE", "unloaded"), ("gpt", "2"): ("READY", "")}, 60,
             "version 2 to serve and version 1 to be released")
        poll(lambda: freed(first), 10, "version 1's engine to free its cache")
        assert [g.version for g in app.generators] == ["2"]
        result = client.infer("gpt", text_input("import"), parameters={**LONG, "max_tokens": 12})
        assert result.get_response().model_version == "2" and result.as_numpy("token_ids").tolist() == want


def test_a_load_with_a_config_override_is_refused_for_a_generative_model(repo):
    import json

    with explicit_mesh(repo, drain_timeout_s=60) as mesh, grpcclient.InferenceServerClient(mesh.address) as client:
        client.load_model("gpt")
        [model] = mesh.executors[0].generators
        with pytest.raises(InferenceServerException, match="'gpt' is generative: a load call's config") as refused:
            client.load_model("gpt", config=json.dumps({"max_batch_size": 4}))
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        # What served goes on serving.
        assert mesh.executors[0].generators == [model] and client.is_model_ready("gpt", "1")
        assert len(greedy_tokens(client, "import", {**LONG, "max_tokens": 4})) == 4
