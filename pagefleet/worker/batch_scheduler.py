"""The per-step scheduling decisions of one engine: who runs, with how many tokens.

Each step, in order:

0. Priority: when the most important waiting sequence outranks running
   ones and its first chunk cannot get blocks or a sequence slot, running
   sequences of lower priority are preempted for it (`_preempt_for_priority`:
   lowest priority, then most recently admitted), but only when those
   victims together make enough room; equal or higher priority is never
   preempted for a waiting sequence.
1. Running sequences, most important first (highest priority, then earliest
   admitted): each gets its remaining tokens (1 in decode, the next chunk of a
   long prefill) within the step's token budget. When its blocks cannot be
   had, victims are preempted (`preemption.choose_victims`) among the
   running sequences not yet scheduled this step, itself included.
2. Swapped sequences come back (swap in) when their blocks fit, unless a
   waiting sequence outranks them; while any is still out, no waiting
   sequence of its priority or lower is admitted, so swapped work is never
   starved by its peers (a higher-priority arrival may still go first).
3. Waiting sequences are admitted in order (higher priority first, then
   first come) within `max_num_seqs` and the budget, each reusing its longest
   cached prefix (the last token is always computed: its logits are needed):
   the pool's run first, then the offload tier's, copied back into fresh blocks.
   A sequence whose next uncached block is being computed right now by
   another (a group of prompts sharing a prefix, submitted together) waits a
   step and then reuses it; the sequences behind it may go first.

LoRA adapters (`EngineConfig.lora_adapters`): a waiting sequence with an
adapter is admitted only when the adapter is resident or can be loaded into a
slot (a free one, or evicting the least recently used adapter that no running
or swapped sequence uses). When none can be had it is passed over, keeping
its place, and so is every adapter request behind it in that step (base-model
requests still go): the in-use slots drain and it cannot be starved.

Preemption modes: "recompute" frees the blocks and requeues the sequence at
the front (its prompt and generated tokens are computed again, usually
hitting its own just-cached blocks); "swap" copies the blocks to a bounded
CPU swap space and frees them (falls back to recompute when the space is
full); "auto" picks per victim whichever the measured costs say is cheaper.

Tenant caps (`EngineConfig.tenant_max_live_blocks`, see `tenant_quota`): a
waiting sequence whose tenant is at its cap is passed over (it keeps its
place; others behind it are admitted), and a running one that needs a block
past the cap preempts its own tenant's sequences (recompute) first.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagefleet.worker.config import EngineConfig
from pagefleet.worker.kv_manager import KVCacheManager
from pagefleet.worker.lora import LoRAManager
from pagefleet.worker.preemption import (
    VictimCandidate,
    choose_mode,
    choose_victims,
    victim_order,
)
from pagefleet.worker.sequence import Sequence, SequenceStatus, SwappedKV
from pagefleet.worker.tenant_quota import TenantBlockQuota

# Starting estimates for "auto" preemption until steps and swaps are measured:
# 0.2 ms per recomputed token (a small model on a CPU core; GPUs are far faster,
# and the moving average corrects it within a few steps) and 4 GB/s for host
# copies (below pinned-memory PCIe and DRAM bandwidth).
INITIAL_RECOMPUTE_SECONDS_PER_TOKEN = 2e-4
INITIAL_SWAP_BYTES_PER_SECOND = 4e9
EMA_WEIGHT = 0.2  # weight of a new measurement in the moving averages


@dataclass
class ScheduledSeq:
    """One sequence in this step: `num_new_tokens` tokens written to `slots`."""

    seq: Sequence
    num_new_tokens: int
    slots: list[int]


@dataclass
class SchedulerOutput:
    """The step's batch, and the copy-on-write block copies to do before it runs."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def _importance(seq: Sequence) -> tuple[int, int]:
    return (-seq.priority, seq.admitted_seq)


class BatchScheduler:
    """Queues (waiting, running, swapped) and the decisions of each step."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        lora: LoRAManager | None = None,
    ) -> None:
        self.config = config
        self.lora = lora
        self.kv = kv
        self.block_size = config.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.preemptions = {"recompute": 0, "swap": 0}
        self.block_preemptions = 0  # of those, for want of a block (not a tenant's cap)
        self.swaps_out = 0
        self.swaps_in = 0
        self.swap_used_bytes = 0
        self.cow_copies = 0
        self.recompute_seconds_per_token = INITIAL_RECOMPUTE_SECONDS_PER_TOKEN
        self.swap_bytes_per_second = INITIAL_SWAP_BYTES_PER_SECOND
        self._admit_counter = 0
        self.quota = TenantBlockQuota(dict(config.tenant_max_live_blocks))

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (no blocks yet)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Add a sequence that already holds blocks (a fork of a running one)."""
        seq.status = SequenceStatus.RUNNING
        seq.admitted_seq = self._next_admit()
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out of every queue and release its blocks and swap space now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        if seq.swapped is not None:
            self.swap_used_bytes -= seq.swapped.num_bytes
            seq.swapped = None
        if seq.table is not None:
            seq.table.free()
            seq.table = None
        seq.status = SequenceStatus.FINISHED

    def _next_admit(self) -> int:
        self._admit_counter += 1
        return self._admit_counter

    # -------------------------------------------------------------- measuring

    def observe_step(self, num_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        """Feed one step's timing into the recompute-cost estimate.

        Only prefill-dominated steps count: recomputing a victim is a prefill.
        """
        if num_tokens > 0 and num_prefill_tokens * 2 >= num_tokens:
            per_token = seconds / num_tokens
            self.recompute_seconds_per_token += EMA_WEIGHT * (
                per_token - self.recompute_seconds_per_token
            )

    def _observe_swap(self, num_bytes: int, seconds: float) -> None:
        if seconds > 0 and num_bytes > 0:
            self.swap_bytes_per_second += EMA_WEIGHT * (
                num_bytes / seconds - self.swap_bytes_per_second
            )

    # --------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch; reserves the slots of every scheduled token."""
        out = SchedulerOutput()
        self._protect_waiting_prefixes()
        budget = self.config.max_num_batched_tokens
        self._preempt_for_priority(budget)
        budget = self._schedule_running(out, budget)
        budget = self._schedule_swapped(out, budget)
        # Swapped work outranks waiting work of its priority or lower (never starved).
        floor = max((s.priority for s in self.swapped), default=None)
        self._schedule_waiting(out, budget, above=floor)
        self.cow_copies += len(out.copies)
        return out

    def _protect_waiting_prefixes(self) -> None:
        """Order the cached blocks so eviction takes those no waiting sequence will reuse first.

        The blocks waiting sequences will hit go to the most-recently-used end,
        the next sequence to be admitted last, and each sequence's first block
        after its later ones (a prefix is only as good as its first block).
        Skipped when the step cannot need more than the free blocks, and bounded
        by the pool's size: sequences further back could not keep theirs anyway.
        """
        if not (self.config.enable_prefix_caching and self.waiting):
            return
        cfg = self.config
        most_a_step_allocates = cfg.max_num_batched_tokens // self.block_size + 2 * cfg.max_num_seqs
        if self.kv.num_free >= most_a_step_allocates:
            return
        wanted: list[list[bytes]] = []
        room = self.kv.num_blocks
        for seq in self.waiting:
            hashes = seq.full_block_hashes(seq.num_tokens - 1, self.block_size)
            wanted.append(hashes)
            room -= len(hashes)
            if room <= 0:
                break
        for hashes in reversed(wanted):
            self.kv.touch(reversed(hashes))

    def _preempt_for_priority(self, budget: int) -> None:
        """Preempt lower-priority running sequences so the most important waiting one fits.

        Its need is estimated before the step: a sequence slot, and blocks for
        its first chunk including the prefix it would reuse (a cached block it
        revives is taken from the allocatable ones). Nothing is preempted
        unless the victims' own blocks (those no other sequence shares) and
        slots together cover that need: a preemption that cannot seat it
        would only throw work away.
        """
        if not self.waiting or not self.running:
            return
        head = max(self.waiting, key=lambda s: s.priority)  # the first of the highest
        lower = [s for s in self.running if s.priority < head.priority]
        if not lower:
            return
        bs = self.block_size
        hits = 0
        if self.config.enable_prefix_caching:
            hits = self.kv.num_leading(head.full_block_hashes(head.num_tokens - 1, bs))
        n = min(head.num_tokens - hits * bs, budget)
        need = -(-(hits * bs + n) // bs)
        blocks = need - self.kv.num_allocatable
        slots = len(self.running) + 1 - self.config.max_num_seqs
        if blocks <= 0 and slots <= 0:
            return
        if self.quota.excess(head.request.salt, need, self.running, self.swapped) > 0:
            return  # its tenant's cap holds it back, not the lack of room
        victims: list[Sequence] = []
        by_id = {s.seq_id: s for s in lower}
        for cand in victim_order(_candidates(lower)):
            if blocks <= 0 and slots <= 0:
                break
            victim = by_id[cand.request_id]
            victims.append(victim)
            assert victim.table is not None
            blocks -= sum(1 for b in victim.table.block_ids if self.kv.ref_count(b) == 1)
            slots -= 1
        if blocks > 0 or slots > 0:
            return  # all of them together could not seat it
        for victim in victims:
            self.preempt(victim)

    def _room(self, out: SchedulerOutput, budget: int) -> bool:
        return budget > 0 and len(out.scheduled) < self.config.max_num_seqs

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=_importance)
        pending = list(self.running)
        for i, seq in enumerate(pending):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if not self._room(out, budget):
                break  # keeps its blocks; runs next step
            assert seq.table is not None
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._fit_quota(seq, n, pending[i + 1 :]):
                continue  # seq itself was preempted to keep its tenant within its cap
            if not self._make_room(seq, n, pending[i + 1 :]):
                continue  # seq itself was preempted
            result = seq.table.append_slots(n)
            out.copies.extend(result.copies)
            out.scheduled.append(ScheduledSeq(seq, n, result.slots))
            budget -= n
        return budget

    def _make_room(self, seq: Sequence, n: int, others: list[Sequence]) -> bool:
        """Preempt until `seq` can get blocks for `n` tokens; False if `seq` was the victim."""
        assert seq.table is not None
        while True:
            needed = seq.table.blocks_needed(n)
            if self.kv.can_allocate(needed):
                return True
            candidates = _candidates([seq, *others])
            victims = choose_victims(candidates, needed - self.kv.num_allocatable)
            by_id = {s.seq_id: s for s in [seq, *others]}
            victim = by_id[victims[0]]
            self.preempt(victim)
            self.block_preemptions += 1
            if victim is seq:
                return False

    def _fit_quota(self, seq: Sequence, n: int, others: list[Sequence]) -> bool:
        """Preempt the tenant's own sequences until `seq`'s next blocks fit its cap.

        False if `seq` itself was the victim. Victims are recomputed, never
        swapped: swapped blocks still count against the cap.
        """
        salt = seq.request.salt
        if self.quota.cap(salt) is None:
            return True
        assert seq.table is not None
        while True:
            excess = self.quota.excess(salt, seq.table.blocks_needed(n), self.running, self.swapped)
            if excess <= 0:
                return True
            mine = [s for s in [seq, *others] if (s.request.salt or "") == (salt or "")]
            victims = choose_victims(_candidates(mine), excess)
            by_id = {s.seq_id: s for s in mine}
            victim = by_id[victims[0]]
            self.quota.refuse(salt)
            self.preempt(victim, force_recompute=True)
            if victim is seq:
                return False

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        self.swapped.sort(key=_importance)
        bs = self.block_size
        # A waiting sequence of higher priority goes first (it may have preempted these).
        outranked_by = max((s.priority for s in self.waiting), default=None)
        while self.swapped and self._room(out, budget):
            seq = self.swapped[0]
            if outranked_by is not None and seq.priority < outranked_by:
                break
            assert seq.swapped is not None
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.can_allocate(-(-(seq.num_computed_tokens + n) // bs)):
                break
            table = self.kv.new_table()
            table.append_slots(seq.num_computed_tokens)
            start = time.perf_counter()
            self.kv.swap_in(seq.swapped.handle, table.block_ids)
            self._observe_swap(seq.swapped.num_bytes, time.perf_counter() - start)
            self.swap_used_bytes -= seq.swapped.num_bytes
            self.swaps_in += 1
            seq.swapped = None
            seq.table = table
            # The swapped-in copies stay unregistered: the originals still hold the
            # hashes in the pool (as cached blocks) until evicted.
            seq.num_registered_blocks = seq.num_computed_tokens // bs
            self.swapped.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            result = table.append_slots(n)
            out.copies.extend(result.copies)
            out.scheduled.append(ScheduledSeq(seq, n, result.slots))
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, above: int | None) -> None:
        """Admit waiting sequences in order; with `above`, only those of higher priority."""
        if any(s.priority != 0 for s in self.waiting):
            self.waiting = deque(sorted(self.waiting, key=lambda s: -s.priority))  # stable
        bs = self.block_size
        caching = self.config.enable_prefix_caching
        inflight = self._inflight_hashes() if caching else set()
        # Passed over this step (a prefix being computed, the tenant at its cap, or no
        # free LoRA slot): they keep their places, ahead of the rest.
        passed: list[Sequence] = []
        adapters_in_use = self._adapters_in_use()
        slot_wait = False  # a sequence found no LoRA slot: later adapter requests wait too
        while self.waiting and self._room(out, budget):
            seq = self.waiting[0]
            if above is not None and seq.priority <= above:
                break  # swapped work of this priority or higher comes back first
            # The last prompt token is always computed: its logits are needed.
            hashes = seq.full_block_hashes(seq.num_tokens - 1, bs) if caching else []
            adapter = seq.request.adapter
            if adapter is not None and (
                slot_wait or not self._can_get_slot(adapter, adapters_in_use)
            ):
                # Every slot holds an adapter running requests use. The adapter requests
                # behind it wait as well, so the slots drain and it is not starved.
                slot_wait = True
                passed.append(self.waiting.popleft())
                continue
            if inflight and self._follows_inflight(hashes, inflight):
                # Its next uncached block is being computed by a sequence admitted
                # earlier: admitted a step later, it hits that block instead of
                # computing it again. Later requests may go ahead of it meanwhile.
                passed.append(self.waiting.popleft())
                continue
            # Cheap optimistic check before lookup() takes refs and counts a query:
            # even if every hashed block hits, the rest of the chunk needs new blocks.
            best_computed = len(hashes) * bs
            best_n = min(seq.num_tokens - best_computed, budget)
            if not self.kv.can_allocate(-(-best_n // bs)):
                break
            if self.quota.excess(seq.request.salt, -(-best_n // bs), self.running, self.swapped) > 0:
                self.quota.refuse(seq.request.salt)
                passed.append(self.waiting.popleft())
                continue
            table = self.kv.new_table()
            hit = self.kv.match(hashes)
            table.append_cached(hit.block_ids)
            computed = table.num_tokens
            num_hit_blocks = len(table.block_ids)
            n = min(seq.num_tokens - computed, budget)
            if not self.kv.can_allocate(table.blocks_needed(n)):
                table.free()
                break
            # Hits revived from the cache (ref count now 1) become live for the tenant too.
            new_live = table.blocks_needed(n) + hit.revived
            if self.quota.excess(seq.request.salt, new_live, self.running, self.swapped) > 0:
                table.free()
                self.quota.refuse(seq.request.salt)
                passed.append(self.waiting.popleft())
                continue
            if adapter is not None:
                assert self.lora is not None
                placed = self.lora.acquire(adapter, adapters_in_use)  # loads it on first use
                assert placed, f"no LoRA slot for {adapter!r} after can_acquire"
                adapters_in_use.add(adapter)
            result = table.append_slots(n)
            self.waiting.popleft()
            seq.table = table
            seq.num_computed_tokens = computed
            seq.num_registered_blocks = num_hit_blocks
            seq.status = SequenceStatus.RUNNING
            seq.admitted_seq = self._next_admit()
            if seq.index == 0 and seq.num_output_tokens == 0:
                seq.request.num_cached_tokens = computed
            self.running.append(seq)
            out.copies.extend(result.copies)
            out.scheduled.append(ScheduledSeq(seq, n, result.slots))
            budget -= n
            inflight.update(hashes[num_hit_blocks:])
        self.waiting.extendleft(reversed(passed))  # back in their order, ahead of the rest

    def _adapters_in_use(self) -> set[str]:
        """Adapters of the running and swapped sequences: their slots are never evicted."""
        return {
            name
            for seq in [*self.running, *self.swapped]
            if (name := seq.request.adapter) is not None
        }

    def _can_get_slot(self, adapter: str, in_use: set[str]) -> bool:
        return self.lora is not None and self.lora.can_acquire(adapter, in_use)

    def _inflight_hashes(self) -> set[bytes]:
        """Hashes of prompt blocks that running sequences are still computing."""
        inflight: set[bytes] = set()
        for seq in self.running:
            if seq.num_registered_blocks < len(seq.block_hashes):
                inflight.update(seq.block_hashes[seq.num_registered_blocks :])
        return inflight

    def _follows_inflight(self, hashes: list[bytes], inflight: set[bytes]) -> bool:
        """Whether the first of `hashes` that is not cached yet is being computed now."""
        for h in hashes:
            if not self.kv.is_cached(h):
                return h in inflight
        return False

    # -------------------------------------------------------------- preemption

    def preempt(self, seq: Sequence, *, force_recompute: bool = False) -> str:
        """Preempt a running sequence; returns the mode used ("recompute" or "swap")."""
        assert seq.table is not None and seq.status is SequenceStatus.RUNNING
        self.running.remove(seq)
        num_bytes = len(seq.table.block_ids) * self.kv.bytes_per_block
        mode = "recompute" if force_recompute else self.config.preemption_mode
        if mode == "auto":
            mode = choose_mode(
                seq.num_computed_tokens,
                num_bytes,
                self.recompute_seconds_per_token,
                self.swap_bytes_per_second,
            )
        if mode == "swap" and self.swap_used_bytes + num_bytes > self.config.swap_space_bytes:
            mode = "recompute"  # swap space full
        if mode == "swap":
            start = time.perf_counter()
            handle = self.kv.swap_out(seq.table.block_ids)
            self._observe_swap(num_bytes, time.perf_counter() - start)
            seq.swapped = SwappedKV(handle, len(seq.table.block_ids), num_bytes)
            self.swap_used_bytes += num_bytes
            self.swaps_out += 1
            seq.table.free()
            seq.table = None
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            seq.table.free()
            seq.table = None
            seq.num_computed_tokens = 0
            seq.num_registered_blocks = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.preemptions[mode] += 1
        return mode


def _candidates(seqs: list[Sequence]) -> list[VictimCandidate]:
    """The running ones among `seqs`, as preemption candidates."""
    return [
        VictimCandidate(
            request_id=s.seq_id,
            priority=s.priority,
            arrival_time=s.request.arrival_time,
            admitted_seq=s.admitted_seq,
            num_blocks=len(s.table.block_ids) if s.table is not None else 0,
        )
        for s in seqs
        if s.status is SequenceStatus.RUNNING
    ]
