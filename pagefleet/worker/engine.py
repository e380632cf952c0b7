"""LLMEngine: continuous batching of many requests over one paged KV pool.

`add_request` validates and queues; each `step()` lets the batch scheduler
pick the step's tokens (running sequences first, then swapped-in, then newly
admitted ones, within `max_num_seqs` and `max_num_batched_tokens`), runs one
forward over all of them packed together, samples a token for every
sequence whose tokens are now all computed, and returns one delta per
completion that progressed. Full blocks are registered in the prefix cache
as soon as they are written, prompt and generated tokens alike.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from pagefleet.kernels.transfer import host_to_device
from pagefleet.worker.batch_scheduler import BatchScheduler, ScheduledSeq
from pagefleet.worker.block_table import blocks_to_finish, request_claim
from pagefleet.worker.config import EngineConfig, default_cpu_kv_bytes
from pagefleet.worker.detokenizer import IncrementalDetokenizer
from pagefleet.worker.events import RequestLoad
from pagefleet.worker.grammar import GrammarError, Grammars, TokenMatcher, mask_logits
from pagefleet.worker.kv_cache import KVCache, ModelShape, blocks_for_budget
from pagefleet.worker.kv_manager import KVCacheManager, KVStats
from pagefleet.worker.kv_migration import ExportedKV
from pagefleet.worker.lora import LoRAUsage
from pagefleet.worker.model_runner import ModelRunner, StepBatch
from pagefleet.worker.outputs import RequestError, RequestOutput
from pagefleet.worker.sampler import TokenHistory, sample, token_logprobs
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.sequence import Request, Sequence, SequenceStatus


@dataclass(frozen=True)
class BlockClaims:
    """`LLMEngine.block_claims`: blocks still to allocate, and per priority
    (requests, blocks they claim in all)."""

    committed: int
    by_priority: dict[int, tuple[int, int]]
    by_request: dict[str, int]  # blocks each request claims in all


@dataclass(frozen=True)
class EngineStats(KVStats):
    """`LLMEngine.stats()`: the KV cache's counters (`KVStats`: blocks by state,
    prefix-cache tokens, the offload tier, migrated blocks) plus the queues,
    preemptions, swaps and LoRA slots.

    `kv_import_failures` (hand-offs recomputed because their blocks could not
    be fetched) is counted by the worker actor; an engine alone reports 0.
    """

    block_size: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    swap_used_bytes: int = 0
    cow_copies: int = 0
    requests_aborted: int = 0
    lora_adapters: int = 0
    lora_resident: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    kv_import_failures: int = 0

    @property
    def preemptions(self) -> dict[str, int]:
        """Preemptions by mode."""
        return {"recompute": self.preemptions_recompute, "swap": self.preemptions_swap}

    @property
    def preemptions_total(self) -> int:
        """Preemptions of either mode."""
        return self.preemptions_recompute + self.preemptions_swap


def _history(seq: Sequence) -> TokenHistory:
    """What the sampler's penalties count for a sequence: its prompt and its output so far."""
    prompt_end = seq.num_prompt_tokens - seq.request.num_resumed_tokens
    return TokenHistory(seq.token_ids[:prompt_end], seq.token_ids[prompt_end:])


def _sampled_rows(
    logits: torch.Tensor, rows: list[int], matchers: list[TokenMatcher | None]
) -> torch.Tensor:
    """The logits rows to sample from, one per sampled completion: the forward's own
    tensor where those are its rows in order (the common step: no 6 MB copy of 32 x
    49,152 floats), else a copy. A grammar masks its rows in place, so then they are
    always a copy: the model's distribution stays in `logits` for logprobs."""
    if rows == list(range(logits.shape[0])) and all(m is None for m in matchers):
        return logits
    return logits.index_select(0, host_to_device(torch.tensor(rows), logits.device))


class LLMEngine:
    """One model, one KV pool, many concurrent requests (not thread-safe; see AsyncEngine)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(
            config.model,
            dtype=config.dtype,
            device=config.device,
            kv_cache_dtype=config.kv_cache_dtype,
            lora_adapters=config.adapter_dirs,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
        )
        self.lora = self.runner.lora  # None when the engine serves no adapters
        self.tokenizer: Any = self.runner.tokenizer
        self.vocab_size: int = self.runner.vocab_size
        self.eos_token_ids: set[int] = set(self.runner.eos_token_ids)
        model_len = self.runner.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_len}"
            )
        self.max_model_len = config.max_model_len or model_len
        shape = self.runner.model_shape
        num_blocks = self._num_kv_blocks(shape)
        # Block pool, KV tensors and offload tier: reached only through the manager.
        self.kv = KVCacheManager(
            KVCache(shape, num_blocks, config.block_size, config.device),
            enable_prefix_caching=config.enable_prefix_caching,
            offload_bytes=config.kv_offload_bytes,
        )
        self.runner.bind_kv_cache(self.kv.cache)
        self.scheduler = BatchScheduler(config, self.kv, self.lora)
        self.requests: dict[str, Request] = {}
        # Structured output: xgrammar's tokenizer info is built on the first such request.
        self.grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self._seed_rng = random.Random(config.seed)
        self._pending: list[RequestOutput] = []  # abort deltas, reported by the next step
        self._num_aborted = 0
        # Tokens run through the model so far (prefill and decode): the engine's progress,
        # which a long prefill advances chunk by chunk before it streams its first token.
        self.tokens_computed = 0
        # The adapter of each registered hash an adapter request computed, while the pool
        # or the offload tier holds it (for `kv_event_adapters`).
        self._adapter_of: dict[bytes, str] = {}

    def _num_kv_blocks(self, shape: ModelShape) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_memory_bytes is not None:
            return blocks_for_budget(shape, cfg.kv_memory_bytes, cfg.block_size)
        if torch.device(cfg.device).type == "cuda":
            # Budget = utilisation share of the device, minus what is used now
            # (weights, other processes) and the activations of a full-budget forward.
            free, total = torch.cuda.mem_get_info(torch.device(cfg.device))
            activations = self.runner.profile_peak_bytes(cfg.max_num_batched_tokens)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - activations
            return blocks_for_budget(shape, budget, cfg.block_size)
        budget = default_cpu_kv_bytes(cfg, shape.bytes_per_token, self.max_model_len)
        return blocks_for_budget(shape, budget, cfg.block_size)

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        salt: str | None = None,
        adapter: str | None = None,
        num_resumed_tokens: int = 0,
    ) -> None:
        """Validate and queue a request; raises RequestError naming the broken limit.

        `priority`: larger is more important (admitted first, preempted last).
        `salt` (the tenant) separates prefix-cache entries between tenants.
        `adapter` names one of `EngineConfig.lora_adapters` (None: the base
        model); its identity enters every prefix hash of the request, so
        adapters and the base model never share a cached block.
        `num_resumed_tokens`: how many tokens at the end of the prompt an earlier
        attempt generated (a request resumed on this worker); penalties count
        them as output.
        """
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        adapter_id = self._adapter_id(adapter)
        prompt_ids = self._prompt_token_ids(prompt)
        self._validate(prompt_ids, params)
        self._validate_tenant_cap(prompt_ids, params, salt)
        if not 0 <= num_resumed_tokens < len(prompt_ids):
            raise RequestError(
                f"num_resumed_tokens must be in [0, {len(prompt_ids)}) for a prompt of "
                f"{len(prompt_ids)} tokens, got {num_resumed_tokens}"
            )
        matcher = self._matcher(params, prompt_ids[len(prompt_ids) - num_resumed_tokens :])
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            priority=priority,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            salt=salt,
            base_seed=base_seed,
            adapter=adapter,
            adapter_id=adapter_id,
            num_resumed_tokens=num_resumed_tokens,
        )
        seq = Sequence(request, 0, list(prompt_ids), self._detokenizer(request))
        seq.matcher = matcher
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def _matcher(self, params: SamplingParams, resumed: list[int]) -> TokenMatcher | None:
        """The request's grammar matcher, having accepted the tokens an earlier attempt
        generated (`resumed`); RequestError when the spec does not compile or they do not fit."""
        if params.structured is None:
            return None
        try:
            return self.grammars.matcher(params.structured, resumed)
        except GrammarError as exc:
            raise RequestError(str(exc)) from None

    def _adapter_id(self, adapter: str | None) -> str | None:
        if adapter is None:
            return None
        served = sorted(self.lora.adapters) if self.lora is not None else []
        if adapter not in served:
            raise RequestError(
                f"unknown LoRA adapter {adapter!r}; this engine serves "
                + (", ".join(repr(n) for n in served) if served else "no adapters")
            )
        assert self.lora is not None
        return self.lora.identity(adapter)

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass the prompt as token ids")
            return [int(t) for t in self.tokenizer.encode(prompt)]
        return [int(t) for t in prompt]

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty: at least 1 token is required")
        for pos, tok in enumerate(prompt_ids):
            if not 0 <= tok < self.vocab_size:
                raise RequestError(
                    f"prompt token id {tok} at position {pos} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        bs = self.config.block_size
        blocks = blocks_to_finish(len(prompt_ids), params.max_tokens, bs)
        if blocks > self.kv.num_blocks:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} needs "
                f"{blocks} KV blocks of {bs} tokens, but the pool has only {self.kv.num_blocks}"
            )
        for tok, _ in params.logit_bias:
            if tok >= self.vocab_size:
                raise RequestError(
                    f"logit_bias token id {tok} is outside the vocabulary [0, {self.vocab_size})"
                )
        for tok in params.stop_token_ids:
            if tok >= self.vocab_size:
                raise RequestError(
                    f"stop_token_ids token id {tok} is outside the vocabulary [0, {self.vocab_size})"
                )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has none")

    def _validate_tenant_cap(
        self, prompt_ids: list[int], params: SamplingParams, salt: str | None
    ) -> None:
        # A request its tenant's cap can never hold would wait forever: refuse it now.
        cap = self.scheduler.quota.cap(salt)
        bs = self.config.block_size
        blocks = blocks_to_finish(len(prompt_ids), params.max_tokens, bs)
        if cap is not None and blocks > cap:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} needs "
                f"{blocks} KV blocks of {bs} tokens, but the tenant's max_live_blocks is {cap}"
            )

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        ids = request.prompt_token_ids
        prompt_end = len(ids) - request.num_resumed_tokens
        return IncrementalDetokenizer(
            self.tokenizer, ids[:prompt_end], request.params.stop, resumed_token_ids=ids[prompt_end:]
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or done.

        Its final delta (finish_reason "abort") comes out of the next `step()`.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self._num_aborted += 1
        for seq in request.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                self._pending.append(self._delta(seq))
        return True

    def export_kv(self, request_id: str) -> ExportedKV | None:
        """A host copy of the request's full, registered blocks with their prefix hashes,
        to continue it on another worker (`KVCacheManager.export_blocks`).

        None when the request is unknown, has several completions (a resumed
        stream carries one), or holds no registered block (prefix caching off).
        The request itself is untouched: the caller aborts it next.
        """
        request = self.requests.get(request_id)
        if request is None or request.params.n != 1 or not self.config.enable_prefix_caching:
            return None
        seq = request.sequences[0]
        hashes = seq.full_block_hashes(seq.num_tokens, self.config.block_size)
        return self.kv.export_blocks(hashes)

    def import_kv(
        self, block_hashes: list[bytes], blocks: torch.Tensor, adapter: str | None = None
    ) -> int:
        """Write blocks another worker exported into this pool as cached blocks under their
        hashes (`KVCacheManager.import_blocks`); returns how many. A request for those
        tokens (same tenant, same `adapter`) then hits them instead of computing them.

        `adapter` is the LoRA adapter the blocks were computed with (None: the base
        model); the KV events of the imported blocks name it (`kv_event_adapters`).
        """
        n = self.kv.import_blocks(block_hashes, blocks)
        if adapter is not None:
            for h in block_hashes:
                if self.kv.holds(h):
                    self._adapter_of[h] = adapter
        return n

    def evict_cached(self, n: int) -> int:
        """Evict up to `n` cached blocks (duplicated elsewhere first, then LRU) to free blocks now.

        Running requests keep their blocks; only unused prefix-cache entries go,
        each with a "removed" KV event, counted in `stats().evictions`.
        Returns how many were evicted. The central scheduler asks for this to
        keep a worker above its free-block watermark.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return self.kv.evict(n)

    def has_unfinished_requests(self) -> bool:
        """True while any request runs or waits, or an abort is still to be reported."""
        return bool(self.requests) or bool(self._pending)

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns one delta per completion that progressed."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        # Spills and offload loads issued while scheduling finish before the
        # forward (and the copy-on-write copies) touch those blocks.
        self.kv.prepare_forward(sched.copies)
        batch = StepBatch(input_ids=[], positions=[], slot_mapping=[], query_start_loc=[0],
                          context_lens=[], block_tables=[],
                          lora_slots=self._lora_slots(sched.scheduled))
        num_prefill = 0
        for item in sched.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            batch.input_ids.extend(seq.token_ids[start : start + n])
            batch.positions.extend(range(start, start + n))
            batch.slot_mapping.extend(item.slots)
            batch.query_start_loc.append(batch.query_start_loc[-1] + n)
            batch.context_lens.append(start + n)
            assert seq.table is not None
            batch.block_tables.append(list(seq.table.block_ids))
            if n > 1:
                num_prefill += n
        started = time.perf_counter()
        logits = self.runner.execute(batch)
        self.tokens_computed += len(batch.input_ids)
        self.scheduler.observe_step(
            len(batch.input_ids), num_prefill, time.perf_counter() - started
        )

        rows: list[int] = []
        sampled: list[Sequence] = []
        for row, item in enumerate(sched.scheduled):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self._register_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the last: no token yet
            request = seq.request
            if request.params.n > 1 and not request.forked:
                request.forked = True
                for index in range(1, request.params.n):
                    rows.append(row)
                    sampled.append(self._fork(seq, index))
            rows.append(row)
            sampled.append(seq)
        if not sampled:
            return outputs
        matchers = [s.matcher for s in sampled]
        tokens = sample(
            mask_logits(_sampled_rows(logits, rows, matchers), matchers),
            [s.request.params for s in sampled],
            [s.draw_generator() for s in sampled],
            [_history(s) for s in sampled],
        )
        self._record_logprobs(logits, rows, sampled, tokens)
        for seq, token in zip(sampled, tokens, strict=True):
            if seq.finish_reason is not None:
                continue  # a sibling completion's failure already ended it
            if token is None:
                outputs.extend(self._fail_request(seq.request, "its logits are not finite (NaN or inf)"))
                continue
            if seq.matcher is not None and not seq.matcher.accept(token):
                # Only when the grammar allowed no token at all (the mask left nothing).
                outputs.extend(self._fail_request(seq.request, f"its grammar rejected token {token}"))
                continue
            self._append_token(seq, token)
            outputs.append(self._delta(seq))
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                if seq.request.finished:
                    self.requests.pop(seq.request.request_id, None)
        return outputs

    def _lora_slots(self, scheduled: list[ScheduledSeq]) -> list[int] | None:
        """Each scheduled sequence's adapter slot (-1: base); None when none has an adapter."""
        if self.lora is None or all(item.seq.request.adapter is None for item in scheduled):
            return None
        lora = self.lora
        return [
            -1 if (name := item.seq.request.adapter) is None else lora.slot_of(name)
            for item in scheduled
        ]

    def _fail_request(self, request: Request, reason: str) -> list[RequestOutput]:
        """End every completion of one request with finish_reason "error"; the batch goes on."""
        message = f"request {request.request_id!r} failed: {reason}; it was stopped"
        self.requests.pop(request.request_id, None)
        deltas = []
        for seq in request.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)
                delta = self._delta(seq)
                delta.error = message
                deltas.append(delta)
        return deltas

    def _record_logprobs(
        self,
        logits: torch.Tensor,
        rows: list[int],
        sampled: list[Sequence],
        tokens: list[int | None],
    ) -> None:
        """Append each sampled token's logprobs to the sequences that asked for them."""
        # A row whose logits were not finite (token None) fails its request instead.
        wanted = [
            i for i, seq in enumerate(sampled) if seq.logprobs is not None and tokens[i] is not None
        ]
        if not wanted:
            return
        entries = token_logprobs(
            logits.index_select(0, host_to_device(torch.tensor([rows[i] for i in wanted]), logits.device)),
            [t for i in wanted if (t := tokens[i]) is not None],
            [sampled[i].request.params.logprobs or 0 for i in wanted],
        )
        for i, entry in zip(wanted, entries, strict=True):
            seq_logprobs = sampled[i].logprobs
            assert seq_logprobs is not None
            seq_logprobs.append(entry)

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        request = parent.request
        child = Sequence(
            request, index, list(parent.token_ids),
            self._detokenizer(request),
        )
        assert parent.table is not None
        child.table = parent.table.fork()  # shares every block; the last one copy-on-write
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks
        child.block_hashes = list(parent.block_hashes)
        # Forked before the first sample: the parent's matcher has accepted only resumed tokens.
        child.matcher = parent.matcher.fork() if parent.matcher is not None else None
        request.sequences.append(child)
        self.scheduler.add_running(child)
        return child

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Make every newly full, written block findable by later prefix lookups."""
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_registered_blocks:
            return
        assert seq.table is not None
        hashes = seq.full_block_hashes(full * bs, bs)
        adapter = seq.request.adapter
        for i in range(seq.num_registered_blocks, full):
            self.kv.register(seq.table.block_ids[i], hashes[i])
            if adapter is not None:
                self._adapter_of[hashes[i]] = adapter
        seq.num_registered_blocks = full

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        params = seq.request.params
        stop_text = seq.detokenizer.add_token(token) if seq.detokenizer is not None else False
        eos = not params.ignore_eos and token in self.eos_token_ids
        # The grammar is complete and its end accepted: nothing else may follow.
        done = seq.matcher is not None and seq.matcher.terminated
        if eos or done or token in params.stop_token_ids or stop_text:
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _delta(self, seq: Sequence) -> RequestOutput:
        output_ids = seq.output_token_ids
        emitted = seq.num_emitted_tokens
        new_ids = output_ids[emitted:]
        seq.num_emitted_tokens = len(output_ids)
        new_text = ""
        text = ""
        if seq.detokenizer is not None:
            new_text = seq.detokenizer.take_delta(final=seq.finish_reason is not None)
            text = seq.detokenizer.emitted_text
        return RequestOutput(
            request_id=seq.request.request_id,
            index=seq.index,
            prompt_token_ids=seq.request.prompt_token_ids,
            new_token_ids=new_ids,
            new_text=new_text,
            token_ids=output_ids,
            text=text,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.request.num_cached_tokens,
            new_logprobs=None if seq.logprobs is None else seq.logprobs[emitted:],
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
        )

    # -------------------------------------------------------------- inspection

    def stats(self) -> EngineStats:
        """Pool counters plus queue lengths, preemptions by mode, swaps and the offload tier.

        `prefix_hit_tokens` counts hits in either tier; `offload_hit_tokens` is
        the part copied back from the offload tier.
        """
        sched = self.scheduler
        return EngineStats(
            **self.kv.stats().as_dict(),
            block_size=self.config.block_size,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            preemptions_recompute=sched.preemptions["recompute"],
            preemptions_swap=sched.preemptions["swap"],
            swaps_out=sched.swaps_out,
            swaps_in=sched.swaps_in,
            swap_used_bytes=sched.swap_used_bytes,
            cow_copies=sched.cow_copies,
            requests_aborted=self._num_aborted,
            lora_adapters=len(self.lora.adapters) if self.lora is not None else 0,
            lora_resident=len(self.lora.table.resident) if self.lora is not None else 0,
            lora_loads=self.lora.loads if self.lora is not None else 0,
            lora_evictions=self.lora.evictions if self.lora is not None else 0,
        )

    def resident_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters in device slots now, least recently used first."""
        return self.lora.table.resident if self.lora is not None else ()

    def lora_usage(self) -> LoRAUsage:
        """The LoRA slots now: capacity, resident adapters, loads and evictions per adapter."""
        return self.lora.usage() if self.lora is not None else LoRAUsage()

    def adapter_ids(self) -> dict[str, str]:
        """Each served adapter's `name:hash` identity (the `adapter_id` of its prefix hashes)."""
        if self.lora is None:
            return {}
        return {name: adapter.identity for name, adapter in self.lora.adapters.items()}

    def tenant_live_blocks(self) -> dict[str, int]:
        """Live blocks per prefix-cache salt (the tenant; "" for requests without one).

        Salts never share a block (the salt is in every prefix hash), so the
        values add up to `stats().live`.
        """
        held: dict[str, set[int]] = {}
        for seq in self.scheduler.running:
            if seq.table is not None:
                held.setdefault(seq.request.salt or "", set()).update(seq.table.block_ids)
        return {salt: len(blocks) for salt, blocks in held.items()}

    def block_claims(self) -> BlockClaims:
        """What the requests here will still take from the pool, and who could be preempted.

        A request claims the blocks it holds when each of its completions
        reaches `max_tokens` (capped by `max_model_len`; `request_claim`);
        `committed` is what its sequences (running, swapped or waiting) do not
        hold yet. Prefix blocks shared with other requests count for each, and
        a finished completion's part until its request ends: overestimates, on
        the safe side for admission.
        """
        bs = self.config.block_size
        held: dict[str, set[int]] = {}
        requests: dict[str, Request] = {}
        sched = self.scheduler
        for seq in [*sched.running, *sched.swapped, *sched.waiting]:
            requests[seq.request.request_id] = seq.request
            blocks = held.setdefault(seq.request.request_id, set())
            if seq.table is not None:
                blocks.update(seq.table.block_ids)
        committed = 0
        by_priority: dict[int, list[int]] = {}
        by_request: dict[str, int] = {}
        for request_id, request in requests.items():
            prompt = len(request.prompt_token_ids)
            max_tokens = min(request.params.max_tokens, self.max_model_len - prompt)
            claim = request_claim(prompt, max_tokens, request.params.n, bs)
            # Its completions share the prompt's blocks: what they hold counts once.
            committed += max(0, claim - len(held[request_id]))
            by_request[request_id] = claim
            entry = by_priority.setdefault(request.priority, [0, 0])
            entry[0] += 1
            entry[1] += claim
        return BlockClaims(
            committed, {p: (n, b) for p, (n, b) in by_priority.items()}, by_request
        )

    def blocks_short(self) -> int:
        """Blocks the waiting and swapped sequences lack beyond free + cached now (0: all fit).

        An estimate for the cluster scheduler, which moves work to a worker
        with room when this stays above 0: each sequence needs its tokens'
        blocks less the leading ones it shares with running sequences (its own,
        cached when it was preempted, are part of the free + cached count).
        """
        sched = self.scheduler
        bs = self.config.block_size
        need = 0
        for seq in [*sched.waiting, *sched.swapped]:
            shared = 0
            if self.config.enable_prefix_caching:
                shared = self.kv.num_leading(seq.full_block_hashes(seq.num_tokens - 1, bs), live_only=True)
            need += -(-seq.num_tokens // bs) - shared
        return max(0, need - self.kv.num_allocatable)

    def request_loads(self) -> list[RequestLoad]:
        """Every single-completion request, as a migration candidate (`RequestLoad`).

        A request not admitted yet (or preempted back to waiting before it
        ever ran) counts as admitted after all the others: the latest.
        """
        sched = self.scheduler
        latest = max((s.admitted_seq for s in sched.running), default=0)
        out: list[RequestLoad] = []
        for seq in [*sched.running, *sched.swapped, *sched.waiting]:
            if seq.request.params.n != 1:
                continue  # a resumed stream carries one completion's tokens
            admitted = seq.admitted_seq if seq.admitted_seq >= 0 else latest + 1 + len(out)
            out.append(RequestLoad(seq.request.request_id, seq.priority, admitted, seq.num_tokens))
        return out

    def tenant_cap_refusals(self) -> dict[str, int]:
        """Per salt: admissions deferred and sequences preempted because of the tenant's cap."""
        return dict(self.scheduler.quota.refusals)

    def drain_kv_events(self) -> list[tuple[str, bytes]]:
        """Prefix-cache events since the last drain: ("stored" | "removed", block hash)
        for the pool, ("offload_stored" | "offload_removed", block hash) for the tier."""
        return self.kv.drain_events()

    def kv_event_adapters(self, events: list[tuple[str, bytes]]) -> tuple[str, ...]:
        """The LoRA adapter of each drained (or snapshot) event's block, "" for the base
        model; () when every one is the base model's (`KVEventBatch.adapters`).

        Hashes held nowhere any more (removed from the pool and not in the offload
        tier) are forgotten here, so call it once per drain, after the drain.
        """
        names = tuple(self._adapter_of.get(h, "") for _, h in events)
        for kind, h in events:
            if kind.endswith("removed") and h in self._adapter_of and not self.kv.holds(h):
                del self._adapter_of[h]
        return names if any(names) else ()

    def mark_duplicated(self, hashes: tuple[bytes, ...]) -> None:
        """The hashes another worker of the pool also holds, by the scheduler: their
        cached blocks are evicted before last copies (`KVCacheManager.mark_duplicated`)."""
        self.kv.mark_duplicated(hashes)

    def snapshot_kv(self) -> list[tuple[str, bytes]]:
        """Every held hash now as ("stored", hash) for the pool and ("offload_stored",
        hash) for the tier, and the pending KV events dropped: a receiver that
        replaces its index with this list is exactly in sync."""
        events = self.kv.snapshot()
        # The drain's removals are not reported: forget the adapters of what is gone.
        self._adapter_of = {h: a for h, a in self._adapter_of.items() if self.kv.holds(h)}
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError unless pool and sequences agree block for block.

        Every block is free, cached or live, each live block's ref count equals
        the number of running sequences holding it, and the offload tier's
        slots are consistent (`KVCacheManager.check_integrity`).
        """
        sched = self.scheduler
        holders: Counter[int] = Counter()
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING, f"{seq} in the running queue"
            assert seq.table is not None, f"running {seq} has no block table"
            assert seq.table.num_tokens == seq.num_computed_tokens, (
                f"{seq}: block table holds {seq.table.num_tokens} tokens"
            )
            holders.update(seq.table.block_ids)
        for seq in [*sched.waiting, *sched.swapped]:
            assert seq.table is None, f"{seq} holds blocks outside the running queue"
        self.kv.check_integrity(holders)
        swap_bytes = sum(s.swapped.num_bytes for s in sched.swapped if s.swapped is not None)
        assert swap_bytes == sched.swap_used_bytes, "swap space accounting is off"
