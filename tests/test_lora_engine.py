"""Multi-LoRA serving: greedy output with an adapter equals HF + PEFT on the same weights.

The tiny model serves two random PEFT adapters (`alpha`: rank 8; `beta`: rank
4 with rsLoRA) next to the base model, in float32. Each output must equal
HF + PEFT's greedy one (a divergence only where PEFT's top-2 logits nearly
tie), alone, in a batch that mixes base and both adapters, after preemption,
and through a worker with a single LoRA slot that alternates the adapters.
The prefix cache keeps adapters apart: the same adapter hits, another
adapter or the base model misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hf_models import check_diverse, hf_greedy, load_hf_reference, prompt_ids, top2_gap
from lora_adapters import build_lora_adapter, load_peft_reference, peft_greedy

from pagefleet import LLM, SamplingParams
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.engine import LLMEngine, RequestError
from pagefleet.worker.tiny_model import ensure_tiny_model

MAX_NEW = 12
PROMPT_LENGTHS = (5, 17, 33, 40)
NEAR_TIE = 1e-4
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@dataclass
class Reference:
    model_dir: Path
    adapters: dict[str, Path]
    prompts: list[list[int]]
    expected: dict[str | None, list[list[int]]]  # adapter (None: base) -> greedy outputs
    oracles: dict[str | None, torch.nn.Module]


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    model_dir = ensure_tiny_model()
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "alpha": build_lora_adapter(model_dir, root / "alpha", seed=1, rank=8),
        "beta": build_lora_adapter(model_dir, root / "beta", seed=2, rank=4, use_rslora=True),
    }
    prompts = [prompt_ids(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]
    oracles: dict[str | None, torch.nn.Module] = {
        None: load_hf_reference(model_dir, dtype=torch.float32)
    }
    expected: dict[str | None, list[list[int]]] = {
        None: [hf_greedy(oracles[None], p, MAX_NEW) for p in prompts]
    }
    for name, path in adapters.items():
        oracles[name] = load_peft_reference(model_dir, path)
        expected[name] = [peft_greedy(oracles[name], p, MAX_NEW) for p in prompts]
    return Reference(model_dir, adapters, prompts, expected, oracles)


@pytest.fixture(scope="module")
def llm(ref: Reference) -> LLM:
    return LLM("tiny", lora_adapters=ref.adapters)


def assert_matches(ref: Reference, adapter: str | None, prompt: list[int], got: list[int]) -> None:
    """Equal to the oracle's greedy output, or leaving it only at a near-tie of its top-2."""
    expected = ref.expected[adapter][ref.prompts.index(prompt)]
    if got == expected:
        return
    at = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
    gap = top2_gap(ref.oracles[adapter], prompt + expected[:at])  # type: ignore[arg-type]
    assert gap < NEAR_TIE, (
        f"adapter {adapter!r}: output diverges at token {at} where the top-2 logit gap is "
        f"{gap:.3g} (not a near-tie): {got} != {expected}"
    )


def test_reference_outputs_are_diverse_and_each_adapter_changes_them(ref: Reference) -> None:
    for outputs in ref.expected.values():
        check_diverse(outputs, min_distinct=30)
    for name in ref.adapters:
        differ = sum(a != b for a, b in zip(ref.expected[name], ref.expected[None], strict=True))
        assert differ == len(ref.prompts), f"adapter {name!r} leaves some outputs unchanged"
    assert ref.expected["alpha"] != ref.expected["beta"]


@pytest.mark.parametrize("adapter", ["alpha", "beta"])
def test_single_requests_with_an_adapter_equal_hf_peft(
    llm: LLM, ref: Reference, adapter: str
) -> None:
    for prompt in ref.prompts:
        (out,) = llm.generate([prompt], GREEDY, adapter=adapter)
        assert_matches(ref, adapter, prompt, out.token_ids)


def mixed_batch(ref: Reference) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt under the base model and both adapters, interleaved."""
    prompts: list[list[int]] = []
    adapters: list[str | None] = []
    for prompt in ref.prompts:
        for adapter in (None, "alpha", "beta"):
            prompts.append(prompt)
            adapters.append(adapter)
    return prompts, adapters


def test_a_batch_mixing_base_and_two_adapters_equals_hf_and_hf_peft(
    llm: LLM, ref: Reference
) -> None:
    prompts, adapters = mixed_batch(ref)
    outs = llm.generate(prompts, GREEDY, adapter=adapters)
    for prompt, adapter, out in zip(prompts, adapters, outs, strict=True):
        assert_matches(ref, adapter, prompt, out.token_ids)
    llm.check_integrity()


def test_adapter_outputs_survive_preemption(ref: Reference) -> None:
    # 8 blocks of 8 tokens: the longest request alone needs 7, so the batch must preempt.
    small = LLM(
        "tiny",
        lora_adapters=ref.adapters,
        block_size=8,
        num_kv_blocks=8,
        enable_prefix_caching=False,
    )
    prompts, adapters = mixed_batch(ref)
    outs = small.generate(prompts, GREEDY, adapter=adapters)
    assert small.stats().preemptions_total > 0
    for prompt, adapter, out in zip(prompts, adapters, outs, strict=True):
        assert_matches(ref, adapter, prompt, out.token_ids)
    small.check_integrity()


def hit_tokens(llm: LLM, prompt: list[int], adapter: str | None) -> int:
    before = llm.stats().prefix_hit_tokens
    llm.generate([prompt], SamplingParams(max_tokens=1), adapter=adapter)
    return llm.stats().prefix_hit_tokens - before


def test_prefix_cache_hits_within_an_adapter_and_misses_across_adapters_and_base(
    llm: LLM,
) -> None:
    prompt = prompt_ids(49, seed=500)  # 3 full blocks before the last token
    assert hit_tokens(llm, prompt, "alpha") == 0
    assert hit_tokens(llm, prompt, "alpha") == 48
    assert hit_tokens(llm, prompt, "beta") == 0
    assert hit_tokens(llm, prompt, None) == 0
    assert hit_tokens(llm, prompt, None) == 48
    assert hit_tokens(llm, prompt, "beta") == 48


def test_one_slot_alternating_two_adapters_loads_each_time_and_keeps_outputs(
    ref: Reference,
) -> None:
    one = LLM("tiny", lora_adapters=ref.adapters, max_loras=1)
    prompt = ref.prompts[1]
    for turn, adapter in enumerate(["alpha", "beta", "alpha", "beta"], start=1):
        (out,) = one.generate([prompt], GREEDY, adapter=adapter)
        assert_matches(ref, adapter, prompt, out.token_ids)
        stats = one.stats()
        assert (stats.lora_loads, stats.lora_evictions) == (turn, turn - 1)
        assert one.engine.resident_adapters() == (adapter,)
    usage = one.engine.lora_usage()  # what the load report carries: per adapter
    assert (usage.slots, usage.resident) == (1, ("beta",))
    assert usage.loads == {"alpha": 2, "beta": 2}
    assert usage.evictions == {"alpha": 2, "beta": 1}


def test_one_slot_serves_a_batch_of_both_adapters_in_turn(ref: Reference) -> None:
    one = LLM("tiny", lora_adapters=ref.adapters, max_loras=1)
    prompts, adapters = mixed_batch(ref)
    outs = one.generate(prompts, GREEDY, adapter=adapters)
    for prompt, adapter, out in zip(prompts, adapters, outs, strict=True):
        assert_matches(ref, adapter, prompt, out.token_ids)
    assert one.stats().lora_loads >= 2


def test_an_adapter_in_use_is_never_evicted_and_the_other_request_waits(ref: Reference) -> None:
    engine = LLMEngine(EngineConfig(lora_adapters=ref.adapters, max_loras=1))
    engine.add_request("a", ref.prompts[0], GREEDY, adapter="alpha")
    engine.step()
    engine.add_request("b", ref.prompts[0], GREEDY, adapter="beta")
    finished: list[str] = []
    while "a" not in finished:
        assert engine.resident_adapters() == ("alpha",)
        assert [s.request.request_id for s in engine.scheduler.waiting] == ["b"]
        finished += [o.request_id for o in engine.step() if o.finished]
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["a", "b"]
    assert engine.resident_adapters() == ("beta",)
    assert engine.stats().lora_loads == 2


def test_an_unknown_adapter_is_refused_with_the_served_names(llm: LLM) -> None:
    with pytest.raises(RequestError, match=r"unknown LoRA adapter 'gamma'.*'alpha', 'beta'"):
        llm.generate(["hello"], GREEDY, adapter="gamma")
    assert not llm.engine.has_unfinished_requests()


def test_an_engine_without_adapters_refuses_any_and_wraps_nothing() -> None:
    plain = LLM("tiny")
    with pytest.raises(RequestError, match="serves no adapters"):
        plain.generate(["hello"], GREEDY, adapter="alpha")
    assert plain.engine.lora is None
    assert not any("LoRA" in type(m).__name__ for m in plain.engine.runner.model.modules())


def test_kv_events_name_the_adapter_of_each_stored_block(llm: LLM) -> None:
    engine = llm.engine
    engine.drain_kv_events()
    prompt = prompt_ids(33, seed=600)  # 2 full blocks
    llm.generate([prompt], SamplingParams(max_tokens=1), adapter="beta")
    llm.generate([prompt], SamplingParams(max_tokens=1))
    events = engine.drain_kv_events()
    adapters = engine.kv_event_adapters(events)
    stored = [name for (kind, _), name in zip(events, adapters, strict=True) if kind == "stored"]
    assert sorted(stored) == ["", "", "beta", "beta"]
    assert engine.kv_event_adapters([("stored", b"x" * 32)]) == ()  # a base-model batch


def test_blocks_imported_by_a_migration_keep_their_adapter_in_kv_events(
    llm: LLM, ref: Reference
) -> None:
    source = llm.engine
    prompt = prompt_ids(33, seed=610)  # 2 full blocks
    source.add_request("moved", prompt, GREEDY, adapter="alpha")
    source.step()  # the prefill registers the prompt's full blocks
    exported = source.export_kv("moved")
    source.abort_request("moved")
    while source.has_unfinished_requests():
        source.step()
    assert exported is not None and len(exported.block_hashes) == 2

    target = LLMEngine(EngineConfig(lora_adapters=ref.adapters))
    assert target.import_kv(list(exported.block_hashes), exported.blocks, adapter="alpha") == 2
    events = target.drain_kv_events()
    assert [kind for kind, _ in events] == ["stored", "stored"]
    assert target.kv_event_adapters(events) == ("alpha", "alpha")
    # The snapshot a resynchronising scheduler reads names them too.
    snapshot = target.snapshot_kv()
    assert target.kv_event_adapters(snapshot) == ("alpha", "alpha")
    target.add_request("resumed", prompt, SamplingParams(max_tokens=1), adapter="alpha")
    while target.has_unfinished_requests():
        target.step()
    assert target.stats().prefix_hit_tokens == 32
