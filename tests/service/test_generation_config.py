"""config.toml's [generation] table, its checks against the graph, sampling parameters, and the asyncio loop."""
from __future__ import annotations

import asyncio
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest

from batchline import demo_decoder
from batchline.testing.decoder import Reference, build_gpt, mixed_prompts
from executor.generation_engine import GenerationEngine, PromptError
from executor.generation_loop import GenerationLoop
from executor.generation_model import CacheTensor, load_decoder, slow_on_gpu
from executor.generation_sampling import SamplingError, SamplingParams
from executor.model_config import ConfigError, read_model_config
from executor.repository import RepositoryError, model_names


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_gpt(tmp_path_factory.mktemp("generation"))


@pytest.fixture
def model_dir(built, tmp_path):
    """A copy of the demo decoder whose config.toml a test may change."""
    copy = tmp_path / "gpt"
    shutil.copytree(built, copy)
    return copy


def with_config(model_dir, old: str, new: str):
    config = model_dir / "config.toml"
    text = config.read_text()
    assert old in text
    config.write_text(text.replace(old, new))
    return model_dir


@pytest.mark.parametrize("old, new, message", [
    ("max_context = 256", "max_context = 1", "generation.max_context must be >= 2"),
    ("max_context = 256", "max_context = 256\nbeam_width = 4", "generation.beam_width: Extra inputs are not permitted"),
    ('"present.3.value"]', ']', "generation.cache_inputs has 8 names and generation.cache_outputs 7"),
    ('"past.3.value"]', '"past.3.value", "past.0.key"]', "generation.cache_inputs names ['past.0.key'] more than once"),
    ("eos_token_ids = [0]", "eos_token_ids = [-1]", "generation.eos_token_ids must be token ids >= 0 (got [-1])"),
    ('tokenizer = "tokenizer"\n', "", "generation.tokenizer: Field required"),
    ("[generation]", "[tokenizer]\npath = \"tokenizer\"\n[generation]",
     "a generative model names its tokenizer in [generation]"),
    ("max_batch_size = 32", "max_batch_size = 0", "max_batch_size of a generative model must be >= 1"),
    ("[generation]", "[sequence_batching]\n[generation]", "[sequence_batching] does not apply to a generative model"),
])
def test_config_errors_name_the_key_and_the_value(model_dir, old, new, message):
    with_config(model_dir, old, new)
    with pytest.raises(ConfigError) as info:
        read_model_config(model_dir / "config.toml")
    assert message in str(info.value) and str(model_dir / "config.toml") in str(info.value)


@pytest.mark.parametrize("old, new, message", [
    ('"present.0.key"', '"present.0.kee"', "cache_outputs names 'present.0.kee', which is not an output of the graph"),
    ('"past.0.key", ', '', "the graph's inputs ['past.0.key'] are neither cache_inputs"),
    ('max_context = 256', 'max_context = 256\nmask_input = "mask"', "mask_input 'mask' is not an input of the graph"),
    ('max_context = 256', 'max_context = 256\nlogits_output = "scores"', "logits_output 'scores' is not an output"),
    ("eos_token_ids = [0]", "eos_token_ids = [0, 5000]", "eos_token_ids [5000] are not in the tokenizer's 4096 ids"),
    ('tokenizer = "tokenizer"', 'tokenizer = "nowhere"', "cannot read"),
    ("max_context = 256", "max_context = 128",
     "cache_in_place binds buffers of max_context 128 positions, but cache input 'past.0.key' has 256"),
])
def test_a_config_that_does_not_fit_the_graph_is_refused_at_load(model_dir, old, new, message):
    if old == '"past.0.key", ':  # drop the pair, so the lists still pair up
        with_config(model_dir, '"present.0.key", ', '')
    with_config(model_dir, old, new)
    with pytest.raises(RepositoryError, match="config.toml") as info:
        load_decoder(model_dir)
    assert message in str(info.value)


def test_a_tokenizer_with_ids_the_graph_has_no_logits_for_is_refused_at_load(model_dir):
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer" / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_tokens(["<extra-a>", "<extra-b>"])  # 4,098 ids against the graph's 4,096 logits
    tokenizer.save(str(path))
    with pytest.raises(RepositoryError) as info:
        load_decoder(model_dir)
    assert "the tokenizer has 4098 ids but the graph's logits 'logits' have 4096" in str(info.value)


def test_the_batch_path_leaves_generative_models_to_the_engine(built):
    (built.parent / "plain").mkdir(exist_ok=True)
    assert model_names(built.parent) == ["plain"]
    assert read_model_config(built / "config.toml").generation.max_context == demo_decoder.MAX_CONTEXT


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1 (got 0)"),
    ({"temperature": -0.5}, "temperature must be a number >= 0"),
    ({"top_p": 0}, "top_p must be in (0, 1] (got 0)"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"seed": -3}, "seed must be an integer >= 0 (got -3)"),
    ({"stop": ("",)}, "stop must be non-empty strings"),
])
def test_sampling_parameters_out_of_range_are_named(kwargs, message):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


async def test_the_asyncio_loop_streams_concurrent_sequences_and_cancels_a_dropped_one(built):
    decoder = load_decoder(built)
    reference = Reference()
    prompts = mixed_prompts(12, seed=5, longest=60)
    engine = GenerationEngine(decoder, 16 * decoder.slot_bytes)

    async with GenerationLoop(engine) as loop:
        async def collect(i, prompt):
            tokens = []
            async for out in loop.generate(str(i), prompt, SamplingParams(max_tokens=12, temperature=0)):
                tokens += out.token_ids
            return tokens

        async def drop_after_two():
            seen = 0
            async for _ in loop.generate("dropped", prompts[0], SamplingParams(max_tokens=200, temperature=0,
                                                                                ignore_eos=True)):
                seen += 1
                if seen == 2:
                    break

        results = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)), drop_after_two())
        with pytest.raises(PromptError, match="the prompt is empty"):
            await collect("empty", [])
        for _ in range(200):
            if not engine.has_work:
                break
            await asyncio.sleep(0.01)
        assert not engine.has_work and engine.cache.used == 0
    assert results[:-1] == [reference.greedy(p, 12) for p in prompts]
    assert loop.steps < 12 * 12  # steps were shared, not one sequence after another


async def test_a_second_stream_of_one_request_id_is_refused_and_leaves_the_first_alone(built):
    decoder = load_decoder(built)
    engine = GenerationEngine(decoder, 4 * decoder.slot_bytes)
    prompt = mixed_prompts(3, seed=9, longest=20)[2]
    async with GenerationLoop(engine) as loop:
        first = loop.generate("r1", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        tokens = (await first.__anext__()).token_ids
        assert loop.generating("r1")
        with pytest.raises(ValueError, match="'r1' is already generating on this executor"):
            await loop.generate("r1", prompt, SamplingParams(max_tokens=5)).__anext__()
        reasons = []
        async for out in first:  # the first stream runs to its end, cancelled by nothing
            tokens += out.token_ids
            reasons.append(out.finish_reason)
    assert len(tokens) == 30 and reasons[-1] == "length" and not engine.has_work


def test_a_temperature_near_zero_or_logits_that_overflowed_still_draw_a_token():
    import numpy as np

    from executor.generation_sampling import choose

    logits = np.array([1.0, 3.0, 2.0], np.float32)
    for temperature in (1e-308, 5e-324, 1e-6):
        assert choose(logits, SamplingParams(temperature=temperature), 1, 0) == 1
    overflowed = np.array([1.0, np.inf, np.nan, np.inf], np.float16)
    assert choose(overflowed, SamplingParams(temperature=0.7), 1, 0) in (1, 3)
    with pytest.raises(SamplingError, match="no finite value"):
        choose(np.array([np.nan, -np.inf], np.float32), SamplingParams(temperature=0.7), 1, 0)


def test_top_k_and_top_p_narrow_the_draw_to_the_likeliest_tokens():
    import numpy as np

    from executor.generation_sampling import choose

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    draws = lambda params: {choose(logits, params, seed=1, index=i) for i in range(300)}  # noqa: E731
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, top_k=1)) == {0}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.5)) == {0}
    assert draws(SamplingParams(temperature=1.0, top_p=0.75)) == {0, 1}
    assert draws(SamplingParams(temperature=0)) == {0}
    # The same seed and index draw the same token, whatever was drawn before.
    assert choose(logits, SamplingParams(), 7, 3) == choose(logits, SamplingParams(), 7, 3)


def test_build_models_writes_the_generative_model(model_repository):
    decoder = load_decoder(model_repository / "gpt")
    assert decoder.config.max_context == demo_decoder.MAX_CONTEXT
    assert decoder.tokenizer.get_vocab_size() == demo_decoder.VOCAB_SIZE
    assert len(decoder.cache) == 2 * demo_decoder.LAYERS
    assert (model_repository / "gpt" / "1" / "model.onnx").stat().st_size < 10_000_000


@pytest.mark.parametrize("spinning", [False, True])
def test_the_decoder_spins_as_the_executor_setting_says(built, spinning):
    from executor.generation_serving import load_generation
    from executor.settings import ExecutorSettings

    served = load_generation(built, "1", ExecutorSettings(allow_spinning=spinning, model_repository=str(built.parent)))
    options = served.loop.engine.decoder.session.get_session_options()
    if spinning:  # ONNX Runtime's own default: no entry
        with pytest.raises(Exception, match="does not have configuration"):
            options.get_session_config_entry("session.intra_op.allow_spinning")
    else:
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_the_decoder_takes_its_threads_as_a_batch_models_instance_does(model_dir):
    """The config's intra_op_threads first, else the executor's, else its cpu_cores: an executor
    given one core does not spread a decoder's runs over the host's."""
    from executor.generation_serving import load_generation
    from executor.settings import ExecutorSettings

    def threads(settings: ExecutorSettings) -> int:
        served = load_generation(model_dir, "1", settings)
        return served.loop.engine.decoder.session.get_session_options().intra_op_num_threads

    repository = str(model_dir.parent)
    assert threads(ExecutorSettings(cpu_cores=1, model_repository=repository)) == 1
    assert threads(ExecutorSettings(cpu_cores=1, intra_op_threads=3, model_repository=repository)) == 3
    with_config(model_dir, "[generation]", "intra_op_threads = 2\n[generation]")
    assert threads(ExecutorSettings(cpu_cores=1, intra_op_threads=3, model_repository=repository)) == 2


def test_a_float16_decoders_slots_take_half_the_bytes_the_shape_says_at_float32(tmp_path):
    # generation.py --dtype float16 sizes the executors' cache budget from Shape.cache_mb. The float32
    # graph built first in the same place has the same config keys: build_gpt must not take it.
    shape = demo_decoder.Shape(layers=2, heads=2, embedding=64)
    build_gpt(tmp_path, shape=shape)
    decoder = load_decoder(build_gpt(tmp_path, shape=shape, dtype="float16"))
    assert decoder.slot_bytes == shape.cache_mb(1, "float16") * 2**20 == shape.cache_mb(1) * 2**20 / 2
    engine = GenerationEngine(decoder, 3 * decoder.slot_bytes + 1)
    assert engine.cache.slots == 3 and engine.cache.nbytes == 3 * decoder.slot_bytes


def test_a_decoder_of_another_shape_builds_loads_and_answers_as_transformers_does(tmp_path):
    # benchmarks/generation.py --shape builds GPT-2 small's shape this way; a tiny one checks the path.
    shape = demo_decoder.Shape(layers=2, heads=2, embedding=64)
    model_dir = tmp_path / "gpt"
    demo_decoder.build(model_dir, shape)
    (model_dir / "config.toml").write_text(shape.config())
    config = read_model_config(model_dir / "config.toml")
    assert len(config.generation.cache_inputs) == 2 * shape.layers
    decoder = load_decoder(model_dir)
    assert len(decoder.cache) == 2 * shape.layers
    assert decoder.slot_bytes == shape.cache_mb(1) * 2**20
    engine = GenerationEngine(decoder, 4 * decoder.slot_bytes)
    prompts = mixed_prompts(3, seed=2, longest=20)
    reference = Reference(shape)
    answers = {}
    for i, prompt in enumerate(prompts):
        engine.add(str(i), prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while engine.has_work:
        for out in engine.step().outputs:
            answers.setdefault(out.request_id, []).extend(out.token_ids)
    assert [answers[str(i)] for i in range(len(prompts))] == [reference.greedy(p, 6) for p in prompts]
    with pytest.raises(ValueError, match="divisible by the heads"):
        demo_decoder.Shape(layers=2, heads=3, embedding=64)


def test_a_float32_cache_in_place_on_cuda_is_named_as_slow_and_nothing_else_is():
    def cache(dtype):
        return [CacheTensor("past_key_0", "present_key_0", 2, 32, np.dtype(dtype))]

    warning = slow_on_gpu("CUDAExecutionProvider", True, cache("float32"))
    assert warning is not None and "float16" in warning and "CPU" in warning
    assert slow_on_gpu("CUDAExecutionProvider", True, cache("float16")) is None
    assert slow_on_gpu("CUDAExecutionProvider", False, cache("float32")) is None  # gathered: attention in the graph
    assert slow_on_gpu("CPUExecutionProvider", True, cache("float32")) is None


async def test_a_stream_waiting_past_its_idle_time_gets_a_tick_while_its_sequence_is_preempted(built):
    """A sequence preempted by a better-priority one makes no token until it is readmitted: its
    consumer, which holds tokens it must send within the flush time, is woken without one."""
    decoder = load_decoder(built)
    engine = GenerationEngine(decoder, 4 * decoder.slot_bytes, max_running=1)
    prompt = mixed_prompts(2, seed=3, longest=8)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    async with GenerationLoop(engine) as loop:
        holding: list[bool] = []  # the consumer holds tokens once this is set: it may not wait
        low = loop.generate("low", prompt[0], long, priority=2, idle=lambda: 0.0 if holding else None)
        assert (await low.__anext__()).token_ids
        high = loop.generate("high", prompt[1], long, priority=1)
        assert (await high.__anext__()).token_ids  # running: "low" was preempted for it
        assert [s.request_id for s in engine.waiting] == ["low"]
        holding.append(True)
        outputs = []
        async for out in low:
            outputs.append(out)
            if out is None:
                break
        assert outputs[-1] is None and [s.request_id for s in engine.waiting] == ["low"]
        await high.aclose()
        await low.aclose()
