"""The continuous-batching engine on the real exported demo decoder, against transformers' generate."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

from batchline.testing.decoder import Reference, build_gpt, mixed_prompts
from executor.generation_cache import CacheBudgetError
from executor.generation_engine import GenerationEngine, PromptError
from executor.generation_model import load_decoder
from executor.generation_sampling import SamplingParams
from executor.generation_text import OutputText

GREEDY = dict(temperature=0)
PROMPTS = mixed_prompts(64, seed=3)
# Output lengths differ, so that sequences leave the running batch at different steps.
LENGTHS = [4 + (7 * i) % 29 for i in range(len(PROMPTS))]


# Both kinds of graph: the demo's, which updates its cache in place, and a traced one whose cache
# the engine gathers into each run and writes back.
@pytest.fixture(scope="module", params=[True, False], ids=["cache in place", "cache gathered"])
def decoder(request, tmp_path_factory):
    return load_decoder(build_gpt(tmp_path_factory.mktemp("generation"), in_place=request.param))


@pytest.fixture(scope="module")
def reference():
    return Reference()


@pytest.fixture(scope="module")
def expected(reference):
    return [reference.greedy(p, n) for p, n in zip(PROMPTS, LENGTHS)]


def engine_for(decoder, slots: int = 64, max_running: int = 0, prefill_chunk: int = 0) -> GenerationEngine:
    engine = GenerationEngine(decoder, slots * decoder.slot_bytes, max_running)
    if prefill_chunk:
        engine.config = engine.config.model_copy(update={"prefill_chunk": prefill_chunk})
    return engine


def drain(engine: GenerationEngine, reports: list | None = None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        report = engine.step()
        if reports is not None:
            reports.append(report)
        for out in report.outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_greedy_one_at_a_time_equals_transformers(decoder, expected):
    engine = engine_for(decoder, prefill_chunk=32)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        engine.add(str(i), prompt, SamplingParams(max_tokens=n, **GREEDY))
        assert drain(engine)[str(i)] == expected[i], f"prompt {i} ({len(prompt)} tokens)"


def test_greedy_together_with_sequences_joining_and_leaving_equals_transformers(decoder, expected):
    engine = engine_for(decoder, slots=24, prefill_chunk=48)
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(zip(PROMPTS, LENGTHS)))
    joined_mid_run = 0
    while pending or engine.has_work:
        # A few new sequences every other step, while earlier ones are mid-prefill or mid-answer.
        if pending and engine.has_work:
            joined_mid_run += 1
        for i, (prompt, n) in pending[:3]:
            engine.add(str(i), prompt, SamplingParams(max_tokens=n, **GREEDY))
        pending = pending[3:]
        for _ in range(2):
            report = engine.step()
            assert len(engine.running) <= engine.max_running
            for out in report.outputs:
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert joined_mid_run > 10
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == expected


def test_long_prompt_is_prefilled_in_chunks_while_the_others_keep_decoding(decoder, reference):
    engine = engine_for(decoder, prefill_chunk=16)
    short = [PROMPTS[2], PROMPTS[3]]
    for i, prompt in enumerate(short):
        engine.add(f"s{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))
    while engine.waiting or not all(s.output for s in engine.running):  # both prefilled, both decoding
        engine.step()
    long_prompt = PROMPTS[1] + PROMPTS[1][:50]
    engine.add("long", long_prompt, SamplingParams(max_tokens=5, **GREEDY))
    reports = []
    tokens = drain(engine, reports)
    prefilling = [r for r in reports if r.prefill_tokens]
    assert len(prefilling) >= len(long_prompt) // 16
    assert all(r.prefill_tokens <= 16 for r in reports)
    # Every step that prefilled part of the long prompt also moved both short sequences on by a token.
    for r in prefilling[:-1]:
        assert sorted(o.request_id for o in r.outputs) == ["s0", "s1"]
    assert tokens["long"] == reference.greedy(long_prompt, 5)
    assert tokens["s0"] == reference.greedy(short[0], 40)[-len(tokens["s0"]):]


def test_cache_budget_bounds_the_running_sequences_and_the_rest_wait(decoder, expected):
    engine = engine_for(decoder, slots=3, prefill_chunk=64)
    assert engine.cache.slots == 3 and engine.cache.nbytes <= 3 * decoder.slot_bytes
    for i in range(10):
        engine.add(str(i), PROMPTS[i], SamplingParams(max_tokens=LENGTHS[i], **GREEDY))
    reports = []
    tokens = drain(engine, reports)
    assert max(r.decoded for r in reports) == 3
    assert engine.cache.used == 0
    assert [tokens[str(i)] for i in range(10)] == expected[:10]


def test_a_budget_below_one_sequence_is_refused_with_the_sizes(decoder):
    with pytest.raises(CacheBudgetError, match=f"holds no sequence: one at max_context 256 takes {decoder.slot_bytes}"):
        GenerationEngine(decoder, decoder.slot_bytes - 1)


def test_higher_priority_preempts_and_the_preempted_recompute_the_same_tokens(decoder, expected):
    engine = engine_for(decoder, slots=4, prefill_chunk=256)
    low = range(4, 8)
    for i in low:
        engine.add(str(i), PROMPTS[i], SamplingParams(max_tokens=LENGTHS[i], **GREEDY), priority=2, arrival=float(i))
    reports = [engine.step() for _ in range(3)]
    for i in (0, 1):
        engine.add(str(i), PROMPTS[i], SamplingParams(max_tokens=LENGTHS[i], **GREEDY), priority=1, arrival=10.0 + i)
    drain(engine, reports)
    preempted = [rid for r in reports for rid in r.preempted]
    # The latest-arrived of the lowest priority go first.
    assert preempted[:2] == ["7", "6"]
    assert all(r.decoded <= 4 for r in reports)
    assert {i: _all(reports, str(i)) for i in [0, 1, *low]} == {i: expected[i] for i in [0, 1, *low]}


def _all(reports, request_id):
    return [t for r in reports for o in r.outputs if o.request_id == request_id for t in o.token_ids]


def test_equal_priority_waits_rather_than_preempting(decoder):
    engine = engine_for(decoder, slots=1)
    engine.add("a", PROMPTS[2], SamplingParams(max_tokens=5, **GREEDY))
    engine.step()
    engine.add("b", PROMPTS[3], SamplingParams(max_tokens=5, **GREEDY))
    reports = []
    drain(engine, reports)
    assert not [rid for r in reports for rid in r.preempted]
    finished = [o.request_id for r in reports for o in r.outputs if o.finished]
    assert finished == ["a", "b"]


def test_eos_ends_a_sequence_unless_ignore_eos(decoder, expected):
    # Make the fourth greedy token the end-of-sequence id for this engine.
    eos = expected[5][3]
    engine = engine_for(decoder)
    engine.eos = frozenset({eos})
    engine.add("stops", PROMPTS[5], SamplingParams(max_tokens=LENGTHS[5], **GREEDY))
    engine.add("goes on", PROMPTS[5], SamplingParams(max_tokens=LENGTHS[5], ignore_eos=True, **GREEDY))
    reports = []
    tokens = drain(engine, reports)
    reasons = {o.request_id: o.finish_reason for r in reports for o in r.outputs if o.finished}
    assert reasons == {"stops": "eos", "goes on": "length"}
    assert tokens["stops"] == expected[5][:4]
    assert tokens["goes on"] == expected[5]


def test_stop_string_cuts_the_text_before_it_and_nothing_past_it_is_sent(decoder, expected):
    tokenizer = decoder.tokenizer
    full = tokenizer.decode(expected[6])
    stop = full[len(full) // 2:len(full) // 2 + 3]
    engine = engine_for(decoder)
    engine.add("a", PROMPTS[6], SamplingParams(max_tokens=LENGTHS[6], stop=(stop, "never appears"), **GREEDY))
    reports = []
    drain(engine, reports)
    outs = [o for r in reports for o in r.outputs]
    sent = "".join(o.text for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert sent == full[:full.find(stop)]


def test_streamed_text_is_the_decoded_output_with_no_broken_characters(decoder):
    tokenizer = decoder.tokenizer
    engine = engine_for(decoder)
    prompt = tokenizer.encode("Ünïcödé 🦊 and ümlauts:").ids
    engine.add("t", prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=4, ignore_eos=True))
    reports = []
    tokens = drain(engine, reports)
    pieces = [o.text for r in reports for o in r.outputs]
    assert "".join(pieces) == tokenizer.decode(tokens["t"]).rstrip("\ufffd")


def test_text_comes_whole_characters_at_a_time_from_tokens_that_split_them(decoder):
    tokenizer = decoder.tokenizer
    text = " Ünïcödé 🦊, 日本語 and ümlauts."
    ids = tokenizer.encode(text).ids
    # Byte-level BPE trained on English: the emoji and the CJK characters are several tokens each.
    assert len(ids) > len(text.split()) * 3
    out = OutputText(tokenizer, tokenizer.encode("Prompt:").ids)
    pieces = []
    for token in ids:
        out.add(token)
        pieces.append(out.take())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # a token that ended mid-character gave no text until the character was whole


def test_a_prompt_of_ids_cut_inside_a_character_leaves_it_to_the_output_whole(decoder):
    tokenizer = decoder.tokenizer
    for text in ("naïve café au lait", "price 20€ now", "smile 🦊 again"):
        ids = tokenizer.encode(text).ids
        for cut in range(1, len(ids)):
            out = OutputText(tokenizer, ids[:cut])
            for token in ids[cut:]:
                out.add(token)
            # What the prompt's ids decode to, less a character they end inside, then the output.
            assert tokenizer.decode(ids[:cut]).rstrip("\ufffd") + out.take(final=True) == text, (text, cut)
    # Random ids: bytes that never make a character keep their U+FFFD in the prompt's text, not the output's.
    for prompt, more in zip(mixed_prompts(20, seed=6, longest=12), mixed_prompts(20, seed=8, longest=12)):
        out = OutputText(tokenizer, prompt)
        for token in more:
            out.add(token)
        before, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + more).rstrip("\ufffd")
        common = next((i for i, (a, b) in enumerate(zip(before, whole)) if a != b), min(len(before), len(whole)))
        assert out.take(final=True) == whole[common:], (prompt, more)


def test_one_sequences_failing_draw_ends_it_alone(decoder, monkeypatch):
    from executor import generation_engine

    engine = engine_for(decoder, slots=4)
    engine.add("good", PROMPTS[1], SamplingParams(max_tokens=8, **GREEDY))
    engine.add("bad", PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.5, seed=1))
    real = generation_engine.choose

    def failing(logits, params, seed, index):
        if params.temperature == 0.5:
            raise ValueError("a draw that fails")
        return real(logits, params, seed, index)

    monkeypatch.setattr(generation_engine, "choose", failing)
    report = engine.step()
    assert [(r, str(e)) for r, e in report.failed] == [("bad", "a draw that fails")]
    assert [o.request_id for o in report.outputs] == ["good"]
    assert [s.request_id for s in engine.running] == ["good"] and engine.cache.used == 1
    assert len(drain(engine)["good"]) == 7


def test_seeded_sampling_repeats_and_survives_preemption(decoder):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=11)
    alone = engine_for(decoder)
    alone.add("x", PROMPTS[8], params)
    first = drain(alone)["x"]
    engine = engine_for(decoder, slots=1)
    engine.add("x", PROMPTS[8], params, priority=3)
    for _ in range(5):
        engine.step()
    engine.add("vip", PROMPTS[9], SamplingParams(max_tokens=3, **GREEDY), priority=1)
    reports = []
    drain(engine, reports)
    assert reports[0].preempted == ["x"]
    assert _all(reports, "x") == first[5:]
    other_seed = engine_for(decoder)
    other_seed.add("x", PROMPTS[8], SamplingParams(max_tokens=20, temperature=0.8, seed=12))
    assert drain(other_seed)["x"] != first


def test_cancel_frees_the_slot_at_the_next_step(decoder):
    engine = engine_for(decoder, slots=2)
    engine.add("a", PROMPTS[2], SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.cache.used == 1
    engine.cancel("a")
    report = engine.step()
    assert [(o.request_id, o.finish_reason) for o in report.outputs] == [("a", "cancelled")]
    assert engine.cache.used == 0 and not engine.has_work


def test_prompts_the_model_cannot_take_are_refused_with_the_reason(decoder):
    engine = engine_for(decoder)
    with pytest.raises(PromptError, match="the prompt is empty"):
        engine.add("a", [], SamplingParams())
    with pytest.raises(PromptError, match="the prompt has 256 tokens; this model's context holds 256"):
        engine.add("a", [1] * 256, SamplingParams())
    with pytest.raises(PromptError, match=r"prompt token ids \[4096\] are not in the tokenizer's 4096 ids"):
        engine.add("a", [1, 4096], SamplingParams())


def test_a_sequence_ends_at_max_context(decoder):
    engine = engine_for(decoder)
    engine.add("a", [7] * 250, SamplingParams(max_tokens=100, ignore_eos=True, **GREEDY))
    reports = []
    tokens = drain(engine, reports)
    assert len(tokens["a"]) == 6
    assert reports[-1].outputs[-1].finish_reason == "length"


def test_a_cancel_of_a_request_the_engine_no_longer_holds_does_not_end_it_when_it_comes_again(decoder):
    engine = engine_for(decoder, slots=2)
    engine.add("a", PROMPTS[2], SamplingParams(max_tokens=3, **GREEDY))
    first = drain(engine)["a"]
    engine.cancel("a")  # its stream closed after the sequence ended: a cancel of nothing held
    engine.add("a", PROMPTS[2], SamplingParams(max_tokens=3, **GREEDY))  # handed back, run again
    reports: list = []
    assert drain(engine, reports)["a"] == first
    assert reports[-1].outputs[-1].finish_reason != "cancelled"
