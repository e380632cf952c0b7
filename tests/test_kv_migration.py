"""Migration by KV transfer between two engines, without Ray: export, import, resume.

A request runs part way on one engine; its full, registered blocks are
exported with their prefix hashes, the request is aborted there, and the
blocks are imported into a second engine of the same model (float64, so
"identical" is exact). Resumed there as prompt + streamed tokens, its greedy
output equals the run without migration token for token, and the second
engine computes only the partial tail block. Both pools stay consistent.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_models import build_tiny_hf_model, check_diverse, prompt_ids

from pagefleet import SamplingParams
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.engine import LLMEngine
from pagefleet.worker.kv_migration import from_bytes, to_bytes

BLOCK_SIZE = 8
MAX_NEW = 24
PROMPT_LEN = 37  # 4 full blocks and a partial one
SPLIT = 10  # tokens generated on the source before the hand-off
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"))


def _engine(model_dir: Path, num_kv_blocks: int = 64) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), dtype="float64", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks
        )
    )


def _run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
         salt: str | None = None) -> tuple[list[int], int]:
    """(generated tokens, cached prompt tokens) of one request run to its end."""
    engine.add_request(request_id, prompt, params, salt=salt)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return tokens, cached


def _assert_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert stats.live == 0 and stats.free + stats.cached == stats.total, stats


def _partial(engine: LLMEngine, request_id: str, prompt: list[int], salt: str) -> list[int]:
    """Run a request on `engine` until SPLIT tokens came, then stop stepping."""
    engine.add_request(request_id, prompt, GREEDY, salt=salt)
    streamed: list[int] = []
    while len(streamed) < SPLIT:
        for out in engine.step():
            streamed.extend(out.new_token_ids)
    return streamed


def test_a_request_resumed_from_transferred_blocks_computes_only_its_tail_and_matches(
    model_dir: Path,
) -> None:
    prompt = prompt_ids(PROMPT_LEN, seed=7)
    want, _ = _run(_engine(model_dir), "ref", prompt, GREEDY, salt="t")
    check_diverse([want], min_distinct=8)

    source, target = _engine(model_dir), _engine(model_dir)
    streamed = _partial(source, "r", prompt, salt="t")
    exported = source.export_kv("r")
    source.abort_request("r")
    while source.has_unfinished_requests():
        source.step()
    assert exported is not None
    context = [*prompt, *streamed]
    full = (len(context) - 1) // BLOCK_SIZE  # registered: the last token's KV is not written yet
    assert len(exported.block_hashes) == full
    # Through the object store's byte form, as between two workers.
    blocks = from_bytes(to_bytes(exported.blocks), exported.dtype_name, exported.blocks.shape)
    assert target.import_kv(list(exported.block_hashes), blocks) == full
    _assert_clean(target)  # imported blocks are cached (ref 0), not live
    assert target.stats().cached == full and target.stats().kv_blocks_imported == full

    rest = SamplingParams(max_tokens=MAX_NEW - len(streamed), ignore_eos=True)
    got, cached = _run(target, "r", context, rest, salt="t")
    assert streamed + got == want
    assert cached == full * BLOCK_SIZE and len(context) - cached < BLOCK_SIZE
    # The other half of isolation: another tenant's same tokens do not hit the imported blocks.
    other, other_cached = _run(target, "o", context, rest, salt="u")
    assert other_cached == 0 and other == got
    assert source.stats().kv_blocks_exported == full
    _assert_clean(source)
    _assert_clean(target)


def test_an_import_skips_held_hashes_and_writes_only_what_fits_beside_live_blocks(
    model_dir: Path,
) -> None:
    prompt = prompt_ids(PROMPT_LEN, seed=8)
    source = _engine(model_dir)
    _partial(source, "r", prompt, salt="t")
    exported = source.export_kv("r")
    source.abort_request("r")
    source.step()
    _assert_clean(source)
    assert exported is not None and len(exported.block_hashes) == 5
    hashes = list(exported.block_hashes)

    # 8 blocks; a request of another tenant keeps 5 of them live.
    small = _engine(model_dir, num_kv_blocks=8)
    small.add_request("busy", prompt_ids(33, seed=9), SamplingParams(max_tokens=4, ignore_eos=True))
    small.step()
    assert small.stats().live == 5
    assert small.import_kv(hashes[:2], exported.blocks[:2]) == 2
    # Those 2 are held now (and kept), 1 block is free: of the other 3, the first fits.
    assert small.import_kv(hashes, exported.blocks) == 1
    small.check_integrity()
    assert small.kv.num_leading(hashes) == 3 and small.stats().live == 5
    while small.has_unfinished_requests():
        small.step()
    _assert_clean(small)
    with pytest.raises(ValueError, match="do not fit this pool"):
        small.import_kv(hashes, exported.blocks.to(torch.float32))
