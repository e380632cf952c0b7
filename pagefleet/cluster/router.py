"""Prefix-affinity request router: a plain class, no Ray, no remote call per request.

The router keeps, per worker, the set of block hashes that worker holds in
its prefix cache, fed asynchronously by the central scheduler's view deltas
(`apply_delta`, see `pagefleet.cluster.fleet_view`). To route a
prompt it computes the prompt's chained block hashes (the workers' own
function, salted by tenant), finds each live worker's longest cached prefix,
and picks the lowest

    cost = w_prefill * uncached_prompt_blocks + w_load * active_blocks + w_queue * waiting
           + w_adapter_load * (the request's LoRA adapter is not resident there)
           + w_adapter_load * (... and no LoRA slot is free there: loading it evicts one)

A worker holds an adapter when its last load report lists it in a device
slot, or when this router sent it a request on that adapter within
`speculative_ttl_s` (it is loading it), never more adapters than its slots
(the most recently sent first): a hot adapter's requests gather on
the workers that hold it. A cold one goes where loading it costs least, and
preferably where a slot is free (fewer adapters held than its
`LoadReport.lora_slots`): an eviction costs a second load, the
evicted adapter's, when its next request comes.

A block the worker holds only in its offload tier (host memory, after its
pool run) costs a copy rather than a prefill: it counts as
`1 - offload_credit` of an uncached block: a tier hit ranks below a pool hit.

A global inverted index maps each hash to a bitmask of the workers holding
it (each worker owns one bit). The match is then one walk along the prompt's
hashes that ANDs masks, narrowing the set of workers still matching, instead
of one walk per worker. Masks are plain ints, so the index (hundreds of
thousands of entries) is a dict of bytes to ints that the garbage collector
does not track: no collection pauses on the routing path.

Several ingress replicas route on one view, each with its own router; what
one replica routed is in nobody else's index until the worker prefills and
reports it (a report interval plus a prefill later). So with
`share_routes` each decision also goes to `on_routed`: the ingress sends it
through the scheduler to the other replicas, whose routers index it as
speculative and count its blocks as the worker's pending load
(`note_routed_elsewhere`), as if they had routed it themselves.

Session affinity: a request that names a session (`session`, a (tenant,
session id) key) goes to the worker its session is pinned to while that
worker is live, among the candidates (it has room) and not overloaded: no
request waits in its engine and its load is within the imbalance guard
above. Otherwise the policy chooses and the session is pinned to its choice
(a re-pin). Pins expire `session_ttl_s` after their last use, at most
`session_max_pins` per pool (`pagefleet.scheduler.session_pins`). Each new
pin goes to `on_pinned`, which the ingress sends through the scheduler to
the other replicas (`apply_pin`), so they all send the session's next turn
to the same worker; a pin used only here is told again before the others'
copies expire. Until a new pin arrives, another replica choosing for the
same session breaks the policy's ties as this one did, by the highest hash
of (session, worker) rather than by a coin: idle workers tie, so two
replicas send a session's turns to one worker even before the pin has
travelled, and a worker's loss moves only the sessions it held.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagefleet.cluster.config import ROUTING_POLICIES, RouterConfig
from pagefleet.scheduler.session_pins import SessionKey, SessionPin, SessionPins
from pagefleet.worker.events import LoadReport
from pagefleet.worker.prefix_hash import hash_token_blocks

if TYPE_CHECKING:
    from pagefleet.scheduler.messages import WorkerDelta


class NoWorkerAvailable(RuntimeError):
    """No live worker in the pool can take the request (maps to UNAVAILABLE)."""

    def __init__(self, pool: str, reason: str = "no live worker") -> None:
        super().__init__(f"pool {pool!r}: {reason}")
        self.pool = pool


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why (for logs, metrics and tests)."""

    worker_id: str
    pool: str
    policy: str
    matched_blocks: int  # the chosen worker's cached prefix, as the router's index sees it
    prompt_blocks: int
    cost: float  # prefix_affinity's score of the chosen worker; 0.0 for the other policies
    num_candidates: int
    offload_blocks: int = 0  # blocks after matched_blocks the chosen worker holds in its tier
    # With a session: "hit" (its pinned worker), "new" (no live pin) or "repin" (its
    # worker was dead, full or overloaded); "" without one.
    session: str = ""


class _Worker:
    __slots__ = (
        "alive",
        "bit",
        "block_size",
        "pending_blocks",
        "pool",
        "report",
        "routed_adapters",
        "speculative",
        "worker_id",
    )

    def __init__(self, worker_id: str, pool: str, block_size: int, bit: int) -> None:
        self.worker_id = worker_id
        self.pool = pool
        self.block_size = block_size
        self.bit = bit  # 1 << slot: this worker's bit in the index masks
        self.alive = True
        self.speculative: dict[bytes, float] = {}  # hash -> expiry, from our own routing
        self.report: LoadReport | None = None
        # Uncached blocks routed here since the last load report: keeps a burst from
        # piling onto one worker between two reports.
        self.pending_blocks = 0
        self.routed_adapters: dict[str, float] = {}  # adapter -> expiry, from our own routing

    def held_adapters(self, now: float) -> list[str]:
        """The adapters this worker holds by this router's account: those it sent here
        within `speculative_ttl_s` (newest first: the worker is loading them), then those
        its last report lists; no more than its slots, since each load past them
        evicted the least recently used (stale reports under load would otherwise make
        a worker look as if it held every adapter routed to it lately)."""
        routed = sorted(
            ((expiry, name) for name, expiry in self.routed_adapters.items() if expiry > now),
            reverse=True,
        )
        held = [name for _, name in routed]
        report = self.report
        if report is not None:
            held += [name for name in report.resident_adapters if name not in held]
            if report.lora_slots > 0:
                del held[report.lora_slots :]
        return held

    def adapter_cost(self, adapter: str, now: float, w_adapter_load: float) -> float:
        """What serving `adapter` here adds: nothing where it is held, a load where a
        slot is free (or the slots are not reported yet), two where one must be evicted."""
        held = self.held_adapters(now)
        if adapter in held:
            return 0.0
        report = self.report
        if report is None or report.lora_slots == 0:
            return w_adapter_load
        return w_adapter_load * (1 if len(held) < report.lora_slots else 2)

    def load(self) -> int:
        live = self.report.live_blocks if self.report is not None else 0
        return live + self.pending_blocks

    def waiting(self) -> int:
        # Routed-but-unreported requests are in pending_blocks already; most of them
        # run at once rather than wait, so they do not count here.
        return self.report.num_waiting if self.report is not None else 0


def _rendezvous(tenant: str, session_id: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{tenant}\0{session_id}\0{worker_id}".encode(), digest_size=8).digest()


class Router:
    """Scores a pool's live workers for a prompt; see the module docstring for the cost."""

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_routed: Callable[[str, str, Sequence[bytes]], None] | None = None,
        on_pinned: Callable[[SessionPin], None] | None = None,
    ) -> None:
        """`on_routed(pool, worker_id, hashes)` is called after each decision when the
        config's `share_routes` is on; `on_pinned(pin)` for each session pin the other
        replicas should learn (a new one, or a refresh before their copies expire)."""
        self.config = config or RouterConfig()
        self._on_routed = on_routed if self.config.share_routes else None
        self._on_pinned = on_pinned
        self.sessions = SessionPins(self.config.session_max_pins, clock=clock)
        self._rng = random.Random(seed)
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._pools: dict[str, list[str]] = {}
        self._pool_block_size: dict[str, int] = {}
        # hash -> mask of workers holding it (confirmed or speculative) / confirmed only
        self._holders: dict[bytes, int] = {}
        self._confirmed: dict[bytes, int] = {}
        self._offload: dict[bytes, int] = {}  # hash -> mask of workers holding it in their tier
        self._by_slot: dict[int, _Worker] = {}
        self._free_slots: list[int] = []
        self._expiries: deque[tuple[float, str, bytes]] = deque()
        self._rr_next: dict[str, int] = {}

    # membership -----------------------------------------------------------------------

    def add_worker(self, worker_id: str, pool: str, *, block_size: int = 16) -> None:
        """Add a worker to a pool (idempotent); a pool's block size is set by its first worker."""
        known = self._pool_block_size.get(pool)
        if known is not None and known != block_size:
            raise ValueError(f"pool {pool!r} has block_size {known}, worker {worker_id!r} has {block_size}")
        existing = self._workers.get(worker_id)
        if existing is not None:
            if existing.pool != pool:
                raise ValueError(f"worker {worker_id!r} is in pool {existing.pool!r}, not {pool!r}")
            return
        self._pool_block_size[pool] = block_size
        slot = self._free_slots.pop() if self._free_slots else len(self._by_slot)
        worker = _Worker(worker_id, pool, block_size, 1 << slot)
        self._workers[worker_id] = worker
        self._by_slot[slot] = worker
        self._pools.setdefault(pool, []).append(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and everything indexed for it; unknown ids are ignored."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._clear_index([worker])
        self.sessions.drop_worker(worker_id)
        self._pools[worker.pool].remove(worker_id)
        slot = worker.bit.bit_length() - 1
        del self._by_slot[slot]
        self._free_slots.append(slot)

    def set_alive(self, worker_id: str, alive: bool) -> None:
        """Take a worker out of (or back into) routing; its index is kept."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.alive = alive

    def workers(self, pool: str | None = None, *, alive_only: bool = False) -> list[str]:
        """Worker ids, optionally of one pool and only the live ones."""
        ids = list(self._workers) if pool is None else list(self._pools.get(pool, ()))
        if alive_only:
            ids = [w for w in ids if self._workers[w].alive]
        return ids

    def block_size(self, pool: str) -> int:
        """Block size of a pool's workers (KeyError if the pool has none)."""
        return self._pool_block_size[pool]

    # state updates --------------------------------------------------------------------

    def apply_load_report(self, report: LoadReport) -> None:
        """Take a worker's latest load; an unknown worker is added (block size 16 if new pool)."""
        worker = self._workers.get(report.worker_id)
        if worker is None:
            self.add_worker(
                report.worker_id, report.pool, block_size=self._pool_block_size.get(report.pool, 16)
            )
            worker = self._workers[report.worker_id]
        if not report.supersedes(worker.report):
            return
        worker.report = report
        worker.pending_blocks = 0

    def apply_delta(self, delta: WorkerDelta) -> None:
        """Apply one change of the scheduler's view: membership, liveness, load, index.

        A delta of an unknown worker adds it; `gone` removes it. Stored and
        removed hashes (and the offload tier's) update the worker's bits in the index (a snapshot's
        deltas follow `clear_index`, so their `stored` lists rebuild it).
        """
        info = delta.info
        if delta.gone:
            self.remove_worker(info.worker_id)
            return
        worker = self._workers.get(info.worker_id)
        if worker is None:
            self.add_worker(info.worker_id, info.pool, block_size=info.block_size)
            worker = self._workers[info.worker_id]
        worker.alive = delta.routable
        if delta.report is not None:
            self.apply_load_report(delta.report)
        bit = worker.bit
        holders, confirmed, speculative = self._holders, self._confirmed, worker.speculative
        for block_hash in delta.stored:
            speculative.pop(block_hash, None)
            confirmed[block_hash] = confirmed.get(block_hash, 0) | bit
            holders[block_hash] = holders.get(block_hash, 0) | bit
        for block_hash in delta.removed:
            speculative.pop(block_hash, None)
            _clear_bit(confirmed, block_hash, bit)
            _clear_bit(holders, block_hash, bit)
        offload = self._offload
        for block_hash in delta.offload_stored:
            offload[block_hash] = offload.get(block_hash, 0) | bit
        for block_hash in delta.offload_removed:
            _clear_bit(offload, block_hash, bit)

    def apply_pin(self, pin: SessionPin) -> None:
        """Take a session pin from the view (another replica's, or this one's own as the
        scheduler ordered it); a pin to a worker this router does not know is ignored."""
        worker = self._workers.get(pin.worker_id)
        if worker is not None and worker.pool == pin.pool:
            self.sessions.put(pin.pool, pin.key, pin.worker_id, pin.ttl_s)

    def clear_index(self, worker_ids: Collection[str] | None = None) -> None:
        """Forget every indexed hash (before applying a snapshot); workers and loads stay.

        With `worker_ids`, forget only those workers' hashes (a scheduler
        shard's snapshot: the other shards' workers keep theirs); O(index size).
        """
        if worker_ids is None:
            self._holders = {}
            self._confirmed = {}
            self._offload = {}
            self._expiries.clear()
            for worker in self._workers.values():
                worker.speculative.clear()
            return
        self._clear_index([self._workers[w] for w in worker_ids if w in self._workers])

    # queries --------------------------------------------------------------------------

    def block_hashes(
        self,
        pool: str,
        token_ids: Sequence[int],
        *,
        salt: str | bytes | None = None,
        adapter_id: str | None = None,
    ) -> list[bytes]:
        """The prompt's chained block hashes as the pool's workers compute them."""
        return hash_token_blocks(
            token_ids, self._pool_block_size.get(pool, 16), salt=salt, adapter_id=adapter_id
        )

    def matched_blocks(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """Length of the contiguous prefix of `hashes` the router believes the worker holds."""
        self._expire()
        bit = self._workers[worker_id].bit
        holders = self._holders
        n = 0
        for h in hashes:
            if not holders.get(h, 0) & bit:
                break
            n += 1
        return n

    # routing --------------------------------------------------------------------------

    def route(
        self,
        pool: str,
        token_ids: Sequence[int],
        *,
        salt: str | bytes | None = None,
        policy: str | None = None,
        exclude: Collection[str] = (),
    ) -> RouteDecision:
        """Pick a worker of `pool` for a tokenized prompt; raises NoWorkerAvailable."""
        hashes = self.block_hashes(pool, token_ids, salt=salt)
        return self.route_hashes(pool, hashes, policy=policy, exclude=exclude)

    def route_hashes(
        self,
        pool: str,
        hashes: Sequence[bytes],
        *,
        policy: str | None = None,
        exclude: Collection[str] = (),
        adapter: str | None = None,
        session: SessionKey | None = None,
    ) -> RouteDecision:
        """Pick a worker for a prompt given its block hashes (the LoRA adapter it runs
        with, None: the base model; its session, None: none); raises NoWorkerAvailable."""
        policy = policy or self.config.policy
        candidates = [
            self._workers[w]
            for w in self._pools.get(pool, ())
            if self._workers[w].alive and w not in exclude
        ]
        if not candidates:
            raise NoWorkerAvailable(pool)
        offloaded = 0
        outcome = ""
        pinned: _Worker | None = None
        if session is not None:
            pinned_id = self.sessions.get(pool, session)
            pinned = self._usable_pin(pinned_id, candidates) if pinned_id is not None else None
            outcome = "hit" if pinned is not None else "new" if pinned_id is None else "repin"
        if pinned is not None:
            chosen, matched, cost = pinned, 0, 0.0
        elif policy == "prefix_affinity":
            chosen, matched, offloaded, cost = self._prefix_affinity(candidates, hashes, adapter, session)
        elif policy == "round_robin":
            chosen, matched, cost = self._round_robin(pool, candidates), 0, 0.0
        elif policy == "least_loaded":
            chosen, matched, cost = self._least_loaded(candidates, session), 0, 0.0
        elif policy == "power_of_two":
            pair = self._rng.sample(candidates, 2) if len(candidates) > 1 else candidates
            chosen, matched, cost = self._least_loaded(pair), 0, 0.0
        else:
            raise ValueError(f"unknown routing policy {policy!r}, expected one of {ROUTING_POLICIES}")
        if pinned is not None or policy != "prefix_affinity":
            matched = self.matched_blocks(chosen.worker_id, hashes)
        if session is not None:
            self._pin(pool, session, chosen, fresh=outcome != "hit")
        self._note_routed(chosen, hashes, matched)
        if adapter is not None:
            chosen.routed_adapters[adapter] = self._clock() + self.config.speculative_ttl_s
        if self._on_routed is not None and hashes:
            self._on_routed(pool, chosen.worker_id, hashes)
        return RouteDecision(
            worker_id=chosen.worker_id,
            pool=pool,
            policy=policy,
            matched_blocks=matched,
            prompt_blocks=len(hashes),
            cost=cost,
            num_candidates=len(candidates),
            offload_blocks=offloaded,
            session=outcome,
        )

    def _usable_pin(self, worker_id: str, candidates: list[_Worker]) -> _Worker | None:
        """The pinned worker, if it is a candidate (live, with room) and not overloaded."""
        worker = self._workers.get(worker_id)
        if worker is None or worker not in candidates:
            return None
        # The prefix scorer's imbalance guard: a session stays where its history is
        # cached until its worker is as overloaded as would cost any prompt its affinity.
        cfg = self.config
        guard = cfg.imbalance_ratio * min(w.load() for w in candidates) + cfg.imbalance_slack_blocks
        if worker.waiting() > 0 or worker.load() > guard:
            return None
        return worker

    def _pin(self, pool: str, session: SessionKey, worker: _Worker, *, fresh: bool) -> None:
        ttl = self.config.session_ttl_s
        share = fresh or self.sessions.needs_sharing(pool, session, ttl)
        self.sessions.put(pool, session, worker.worker_id, ttl, shared=share)
        if share and self._on_pinned is not None:
            self._on_pinned(SessionPin(pool, *session, worker.worker_id, ttl))

    def _prefix_affinity(
        self,
        candidates: list[_Worker],
        hashes: Sequence[bytes],
        adapter: str | None = None,
        session: SessionKey | None = None,
    ) -> tuple[_Worker, int, int, float]:
        candidate_mask = 0
        for w in candidates:
            candidate_mask |= w.bit
        matches = self._match_lengths(hashes, candidate_mask)
        cfg = self.config
        n = len(hashes)
        loads = [w.load() for w in candidates]
        guard = cfg.imbalance_ratio * min(loads) + cfg.imbalance_slack_blocks
        best: list[_Worker] = []
        best_cost = 0.0
        tier = self._offload_lengths(candidates, hashes, matches) if self._offload else {}
        now = self._clock()
        for w, load in zip(candidates, loads, strict=True):
            credited: float = 0.0
            if load <= guard:
                credited = matches.get(w.bit, 0) + cfg.offload_credit * tier.get(w.bit, 0)
            cost = cfg.w_prefill * (n - credited) + cfg.w_load * load + cfg.w_queue * w.waiting()
            if adapter is not None:
                cost += w.adapter_cost(adapter, now, cfg.w_adapter_load)
            if not best or cost < best_cost:
                best, best_cost = [w], cost
            elif cost == best_cost:
                best.append(w)
        chosen = self._tie_break(best, session)
        # Report the real match (what the worker will reuse), even where the guard
        # did not credit it in the cost.
        return chosen, matches.get(chosen.bit, 0), tier.get(chosen.bit, 0), best_cost

    def _offload_lengths(
        self, candidates: list[_Worker], hashes: Sequence[bytes], matches: dict[int, int]
    ) -> dict[int, int]:
        """Per worker bit, how many hashes after its pool match its offload tier holds.

        The worker walks its pool first, then its tier; only a run that starts at
        the first block counts (a tier-only first block still counts, from 0).
        """
        offload = self._offload
        out: dict[int, int] = {}
        for w in candidates:
            start = matches.get(w.bit, 0)
            i = start
            while i < len(hashes) and offload.get(hashes[i], 0) & w.bit:
                i += 1
            if i > start:
                out[w.bit] = i - start
        return out

    def _match_lengths(self, hashes: Sequence[bytes], candidate_mask: int) -> dict[int, int]:
        """Per worker bit, the length of its contiguous cached prefix of `hashes` (absent = 0)."""
        self._expire()
        if not hashes:
            return {}
        holders = self._holders
        alive = holders.get(hashes[0], 0) & candidate_mask
        if not alive:
            return {}
        # Hash chaining means "block i cached" implies its prefix was computed,
        # but an evicted middle block breaks reuse, so contiguity is checked.
        lengths: dict[int, int] = {}
        depth = len(hashes)
        for i in range(1, len(hashes)):
            mask = holders.get(hashes[i], 0)
            dropped = alive & ~mask
            if dropped:
                while dropped:
                    low = dropped & -dropped
                    lengths[low] = i
                    dropped ^= low
                alive &= mask
                if not alive:
                    return lengths
        while alive:
            low = alive & -alive
            lengths[low] = depth
            alive ^= low
        return lengths

    def _round_robin(self, pool: str, candidates: list[_Worker]) -> _Worker:
        i = self._rr_next.get(pool, 0)
        self._rr_next[pool] = i + 1
        return candidates[i % len(candidates)]

    def _least_loaded(self, candidates: list[_Worker], session: SessionKey | None = None) -> _Worker:
        cfg = self.config
        scored = [(cfg.w_load * w.load() + cfg.w_queue * w.waiting(), w) for w in candidates]
        low = min(s for s, _ in scored)
        return self._tie_break([w for s, w in scored if s == low], session)

    def _tie_break(self, best: list[_Worker], session: SessionKey | None) -> _Worker:
        """One of equally good workers: a coin without a session; with one, the same
        worker on every replica (rendezvous hashing, see the module docstring)."""
        if len(best) == 1:
            return best[0]
        if session is None:
            return self._rng.choice(best)
        tenant, session_id = session
        return max(best, key=lambda w: _rendezvous(tenant, session_id, w.worker_id))

    def note_routed_elsewhere(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        """Another replica routed a prompt with these block hashes to `worker_id`:
        index them as speculative here too (the worker will store them)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            matched = self.matched_blocks(worker_id, hashes)
            worker.pending_blocks += len(hashes) - matched
            self._speculate(worker, hashes[matched:])

    def _note_routed(self, worker: _Worker, hashes: Sequence[bytes], matched: int) -> None:
        worker.pending_blocks += len(hashes) - matched
        self._speculate(worker, hashes[matched:])

    def _speculate(self, worker: _Worker, hashes: Sequence[bytes]) -> None:
        ttl = self.config.speculative_ttl_s
        if ttl <= 0:
            return
        # The worker will store these blocks once it prefills them; count them now so
        # the next request with the same prefix follows this one.
        expiry = self._clock() + ttl
        bit = worker.bit
        holders, confirmed = self._holders, self._confirmed
        for h in hashes:
            if confirmed.get(h, 0) & bit:
                continue
            worker.speculative[h] = expiry
            holders[h] = holders.get(h, 0) | bit
            self._expiries.append((expiry, worker.worker_id, h))

    # index maintenance ----------------------------------------------------------------

    def _expire(self) -> None:
        expiries = self._expiries
        if not expiries:
            return
        now = self._clock()
        while expiries and expiries[0][0] <= now:
            expiry, wid, h = expiries.popleft()
            worker = self._workers.get(wid)
            if worker is None or worker.speculative.get(h) != expiry:
                continue  # confirmed, removed or re-speculated since
            del worker.speculative[h]
            if not self._confirmed.get(h, 0) & worker.bit:
                _clear_bit(self._holders, h, worker.bit)

    def _clear_index(self, workers: Sequence[_Worker]) -> None:
        # O(index size) once for all of them; only on worker removal or a shard's snapshot.
        bits = 0
        for worker in workers:
            bits |= worker.bit
            worker.speculative.clear()  # their expiry entries no longer match and are skipped
        if not bits:
            return
        for index in (self._holders, self._confirmed, self._offload):
            for h in [h for h, mask in index.items() if mask & bits]:
                _clear_bit(index, h, bits)


def _clear_bit(index: dict[bytes, int], block_hash: bytes, bit: int) -> None:
    mask = index.get(block_hash, 0) & ~bit
    if mask:
        index[block_hash] = mask
    else:
        index.pop(block_hash, None)
