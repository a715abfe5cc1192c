"""Model repository loading and execution-provider selection (real ONNX Runtime sessions)."""
from __future__ import annotations

import os
import shutil

import onnxruntime as ort
import pytest

from executor.repository import RepositoryError, load_repository, read_config
from executor.sessions import choose_providers, create_session, intra_op_threads_for
from executor.settings import DEFAULT_PROVIDERS


def test_providers_keep_preference_order_and_skip_what_the_build_lacks():
    available = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    chosen = choose_providers(DEFAULT_PROVIDERS, {"CUDAExecutionProvider": {"device_id": 0}}, available)
    assert chosen == [("CUDAExecutionProvider", {"device_id": 0}), ("CPUExecutionProvider", {})]
    # CPU is always the last resort, even when not asked for.
    assert choose_providers(["TensorrtExecutionProvider"], {},
                            ["CPUExecutionProvider"]) == [("CPUExecutionProvider", {})]


def test_session_falls_back_to_cpu_when_a_gpu_provider_fails(model_repository):
    # This CPU-only build lacks TensorRT, as a host without CUDA would: the session must still come up, on CPU.
    session = create_session(
        model_repository / "mlp" / "1" / "model.onnx",
        [("TensorrtExecutionProvider", {"trt_fp16_enable": True}), ("CPUExecutionProvider", {})],
        intra_op_threads=1,
    )
    assert session.get_providers() == ["CPUExecutionProvider"]


def test_loaded_models_report_the_providers_actually_used(model_repository):
    models = {m.name: m for m in load_repository(model_repository, providers=DEFAULT_PROVIDERS)}
    assert set(models) == {"minilm", "mlp"}
    expected = [p for p in ort.get_available_providers() if p in DEFAULT_PROVIDERS]
    for m in models.values():
        assert list(m.info.providers) == m.session.get_providers()
        assert set(m.info.providers) <= set(expected)
    minilm = models["minilm"].info
    assert minilm.max_batch_size == 32 and list(minilm.padded_inputs) == ["attention_mask", "input_ids"]
    assert [(s.name, s.datatype, list(s.shape)) for s in minilm.outputs] == [("sentence_embedding", "FP32", [-1, 384])]


def test_only_named_models_are_loaded_and_unknown_ones_refused(model_repository):
    assert [m.name for m in load_repository(model_repository, only=["mlp"])] == ["mlp"]
    with pytest.raises(RepositoryError, match="nope"):
        load_repository(model_repository, only=["mlp", "nope"])


def _one_model(root, model_repository):
    """<root>/m/1/model.onnx (the demo mlp), for a config.toml of the test's own."""
    model = root / "m"
    (model / "1").mkdir(parents=True)
    shutil.copy(model_repository / "mlp" / "1" / "model.onnx", model / "1" / "model.onnx")
    return model


def test_config_errors_name_the_problem(tmp_path, model_repository):
    with pytest.raises(RepositoryError, match="does not exist"):
        load_repository(tmp_path / "missing")
    with pytest.raises(RepositoryError, match="no models"):
        load_repository(tmp_path)
    model = _one_model(tmp_path, model_repository)
    for text, problem in [
        ("max_batch_size = 4\nmax_batch = 3\n", "unknown keys.*max_batch"),
        ("max_batch_size = 4\n[padding]\ntokens = 0\n", "tokens"),
        ("default_timeout_ms = 0\n", "default_timeout_ms must be a finite number > 0"),
        ("default_timeout_ms = inf\n", "default_timeout_ms must be a finite number > 0"),
        ("max_queue_delay_ms = -1\n", "max_queue_delay_ms must be a finite number >= 0"),
        ("max_queue_delay_ms = nan\n", "max_queue_delay_ms must be a finite number >= 0"),
        # Each travels as a uint32: accepted, they failed the model's load as if ONNX Runtime had.
        ("max_batch_size = 4294967296\n", "max_batch_size must be from 0 to 4294967295"),
        ("priority_levels = -1\n", "priority_levels must be from 0"),
        ("max_queue_size = -5\n", "max_queue_size must be from 0"),
        ("default_priority = 0\n", "default_priority must be from 1"),
        ("preferred_batch_sizes = [4, -2]\n", r"preferred_batch_sizes must be batch sizes >= 1 \(got \[-2\]\)"),
        ("priority_levels = 2\ndefault_priority = 3\n", "default_priority 3 is past priority_levels 2"),
    ]:
        (model / "config.toml").write_text(text)
        with pytest.raises(RepositoryError, match=problem):
            load_repository(tmp_path)
    (model / "config.toml").write_text("max_batch_size = 4\n")
    (loaded,) = load_repository(tmp_path)
    assert loaded.info.max_batch_size == 4 and loaded.info.default_timeout_ms == 10_000


def test_a_model_name_with_a_colon_is_refused(tmp_path, model_repository):
    model = _one_model(tmp_path, model_repository)
    model.rename(tmp_path / "m:x")
    with pytest.raises(RepositoryError, match="may not contain ':'"):
        load_repository(tmp_path)


def test_instance_count_splits_the_cores_between_runs_unless_threads_are_configured(tmp_path, model_repository):
    cores = len(os.sched_getaffinity(0))
    assert intra_op_threads_for(1) == 0  # one run at a time: ONNX Runtime's own default
    assert intra_op_threads_for(2) == max(1, cores // 2)
    assert intra_op_threads_for(4 * cores) == 1
    assert intra_op_threads_for(2, configured=3) == 3  # the executor's intra_op_threads wins
    # cpu_cores (a container's CPU limit) is what the instances share, one instance included.
    assert [intra_op_threads_for(n, cores=4) for n in (1, 2, 3, 8)] == [4, 2, 1, 1]
    model = _one_model(tmp_path, model_repository)
    (model / "config.toml").write_text("instance_count = 0\n")
    with pytest.raises(RepositoryError, match="instance_count must be an integer >= 1"):
        read_config(model)
    (model / "config.toml").write_text("instance_count = 3\n")
    (loaded,) = load_repository(tmp_path)
    assert loaded.instances == 3
    (model / "config.toml").write_text("")
    assert load_repository(tmp_path)[0].instances == 1


def test_a_graph_with_a_fixed_first_dimension_is_batched_only_as_it_allows(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    model = tmp_path / "fixed"
    (model / "1").mkdir(parents=True)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "fixed",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model / "1" / "model.onnx")
    # Batched by default (max_batch_size 8): a warm-up or a batch of two would fail in ONNX Runtime.
    with pytest.raises(RepositoryError, match="input 'x' has a fixed first dimension of 1, but max_batch_size 8"):
        load_repository(tmp_path)
    (model / "config.toml").write_text("max_batch_size = 0\n")
    (loaded,) = load_repository(tmp_path)
    assert loaded.info.max_batch_size == 0


def test_padding_is_refused_where_an_output_carries_the_padded_axis(tmp_path):
    """Outputs are split back by rows only: a token-level output of a padded batch would give each
    request its batch's longest length. A pooled output (no padded axis) may be padded."""
    import onnx
    from onnx import TensorProto, helper

    def save(name: str, pooled: bool) -> None:
        (tmp_path / name / "1").mkdir(parents=True)
        nodes = [helper.make_node("Cast", ["ids"], ["tokens"], to=TensorProto.FLOAT)]
        out = "tokens"
        if pooled:
            nodes.append(helper.make_node("ReduceSum", ["tokens"], ["pooled"], keepdims=0, axes=[1]))  # opset 11
            out = "pooled"
        shape = ["batch"] if pooled else ["batch", "sequence"]
        graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("ids", TensorProto.INT64,
                                                                             ["batch", "sequence"])],
                                  [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]),
                  tmp_path / name / "1" / "model.onnx")
        (tmp_path / name / "config.toml").write_text("[padding]\nids = 0\n")

    save("tokens", pooled=False)
    with pytest.raises(RepositoryError, match="pads the axis \\['sequence'\\] that output 'tokens' carries too"):
        load_repository(tmp_path, ["tokens"])
    save("pooled", pooled=True)
    (loaded,) = load_repository(tmp_path, ["pooled"])
    assert loaded.padding == {"ids": 0}
