"""SamplingParams validation, the sampler's filters and incremental detokenization."""

from __future__ import annotations

import re

import pytest
import torch

from pagefleet.kernels.cpu_layers import layer_kernels
from pagefleet.worker.detokenizer import IncrementalDetokenizer
from pagefleet.worker.sampler import greedy_picks, sample, sampling_probs
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.tiny_model import build_tiny_tokenizer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0 and finite, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be >= 0 and finite, got nan"),
        ({"temperature": float("inf")}, "temperature must be >= 0 and finite, got inf"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan"),
        ({"seed": 2**64}, "seed must be a 64-bit integer"),
        ({"stop": ("x",) * 17}, "at most 16 stop strings are allowed, got 17"),
        ({"stop": ("x" * 257,)}, "stop strings must be at most 256 characters, got 257"),
        ({"stop_token_ids": (1,) * 65}, "at most 64 stop_token_ids are allowed, got 65"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"n": 0}, "n must be an integer >= 1, got 0"),
        ({"stop": ("",)}, "stop strings must be non-empty"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids must be >= 0"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_limit(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        SamplingParams(**kwargs)


def test_sampling_params_accept_a_single_stop_string() -> None:
    assert SamplingParams(stop="END").stop == ("END",)


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 5e-324, 9e-6])
def test_temperature_below_the_epsilon_is_greedy(temperature: float) -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    assert sample(logits, [params], [torch.Generator().manual_seed(0)]) == [1]


def test_a_non_finite_row_gets_none_and_the_other_rows_their_tokens() -> None:
    logits = torch.tensor(
        [[0.0, 3.0, 1.0], [float("nan"), 0.0, 0.0], [0.0, float("inf"), 0.0], [4.0, 0.0, 0.0]]
    )
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=0.5, top_k=1)]
    gens = [None, None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    assert sample(logits, params, gens) == [1, None, None, 0]


def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token() -> None:
    row = torch.tensor([0.0, 5.0, 1.0])
    probs = sampling_probs(row, SamplingParams(temperature=1.0, top_p=1e-300))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_greedy_rows_take_the_first_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [None, None]) == [1, 0]


@pytest.mark.parametrize("vocab", [1, 7, 31, 32, 33, 100, 49152])
def test_greedy_picks_in_c_equal_torchs_max_on_ties_nan_and_infinities(vocab: int) -> None:
    # The C pass (float32 CPU rows) against torch's max(dim=-1), the path of every other
    # tensor: 32 floats a step in 4 vectors, then the row's tail, so the vocab sizes put the
    # first maximum in each part and ties across them.
    assert layer_kernels() is not None, "the C library builds on every test machine"
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen)
    logits[1] = 0.0  # all tied: index 0
    logits[2, vocab // 2] = float("nan")
    logits[3, -1] = float("inf")
    logits[4] = float("-inf")
    logits[5, 0], logits[5, -1] = 100.0, 100.0  # the first of a tie, the other in the tail
    logits[6, -1] = 100.0  # the maximum in the tail
    logits[7] = torch.randint(0, 3, (vocab,), generator=gen).float()  # many ties
    logits[8, 0], logits[8, -1] = float("nan"), float("inf")
    logits[9] = float("-inf")
    logits[9, -1] = -1e30
    logits[10, vocab // 3], logits[10, vocab - 1 - vocab // 3] = 50.0, 50.0
    for rows in (logits, logits[:, : max(1, vocab - 1)]):  # dense rows, then a longer stride
        top, index = rows.double().max(dim=-1)
        expected = torch.where(top.isnan() | top.isposinf(), -1, index).tolist()
        assert greedy_picks(rows) == expected
        assert greedy_picks(rows.double()) == expected  # torch's path


def test_top_k_one_always_picks_the_argmax() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=5.0, top_k=1)
    gen = torch.Generator().manual_seed(1)
    picks = {sample(logits, [params], [gen])[0] for _ in range(20)}
    assert picks == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = sampling_probs(row, SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 alone < 0.8, 0.5 + 0.3 reaches it: the two most likely stay, renormalised.
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_k_keeps_exactly_k_tokens() -> None:
    row = torch.tensor([1.0, 4.0, 2.0, 3.0])
    probs = sampling_probs(row, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, False, True]


def test_seeded_draws_do_not_depend_on_batch_mates() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    alone = [sample(logits[1:2], [params], [torch.Generator().manual_seed(7)])[0]]
    gens = [torch.Generator().manual_seed(s) for s in (1, 7, 3)]
    batched = sample(logits, [params] * 3, gens)
    assert batched[1] == alone[0]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_tiny_tokenizer()


def run_detok(
    tokenizer, text: str, stop: tuple[str, ...]
) -> tuple[list[str], IncrementalDetokenizer]:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), stop)
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        stopped = detok.add_token(token)
        deltas.append(detok.take_delta(final=stopped))
        if stopped:
            break
    return deltas, detok


def test_incremental_text_equals_decoding_everything(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "The café served crème brûlée — naïve 猫 emoji 🙂 done."
    deltas, _ = run_detok(tokenizer, text, ())
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_is_cut_from_the_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    deltas, detok = run_detok(tokenizer, "alpha beta STOP gamma", ("STOP",))
    assert detok.stopped
    assert "".join(deltas) == detok.text
    assert detok.text.rstrip() == "alpha beta"


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer) -> None:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), ("world peace",))
    streamed = ""
    for token in tokenizer.encode("hello world", add_special_tokens=False):
        detok.add_token(token)
        streamed += detok.take_delta()
    assert not detok.stopped
    assert streamed == "hello "  # "world" could still become "world peace"
    assert streamed + detok.take_delta(final=True) == "hello world"


def _streamed_with_a_resumption_at(tokenizer, ids: list[int], k: int, stop: tuple[str, ...]) -> str:  # type: ignore[no-untyped-def]
    """What a client receives when the first attempt streams `ids[:k]` and dies, and the
    request resumes elsewhere with those tokens at the end of its prompt."""
    prompt = tokenizer.encode("Hi")
    first = IncrementalDetokenizer(tokenizer, prompt, stop)
    streamed = ""
    for token in ids[:k]:
        stopped = first.add_token(token)
        streamed += first.take_delta(final=stopped)
        if stopped:
            return streamed
    resumed = IncrementalDetokenizer(tokenizer, prompt, stop, resumed_token_ids=ids[:k])
    for token in ids[k:]:
        stopped = resumed.add_token(token)
        streamed += resumed.take_delta(final=stopped)
        if stopped:
            return streamed
    return streamed + resumed.take_delta(final=True)


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The café served crème brûlée — naïve 猫 emoji 🙂 done.", ()),
        ("alpha beta STOP gamma", ("STOP",)),
        ("hello world peace and quiet", ("world peace",)),
    ],
)
def test_a_resumed_stream_continues_the_text_exactly_at_every_resumption_point(
    tokenizer, text: str, stop: tuple[str, ...]  # type: ignore[no-untyped-def]
) -> None:
    # Held-back text (a partial character, what may begin a stop string) reaches the
    # client after the resumption, and a stop string straddling it still matches.
    ids = tokenizer.encode(text, add_special_tokens=False)
    no_fault = _streamed_with_a_resumption_at(tokenizer, ids, len(ids), stop)
    assert not stop or stop[0] not in no_fault
    for k in range(len(ids)):
        assert _streamed_with_a_resumption_at(tokenizer, ids, k, stop) == no_fault, k
