"""Structured output on a worker: grammars compiled by xgrammar, one matcher per sequence.

xgrammar is imported when the first grammar is compiled (it imports transformers:
an engine that never sees a structured request does not pay for either).

`Grammars` belongs to one engine (one model): it builds xgrammar's tokenizer
info once, compiles each `StructuredOutput` once (an LRU keyed by the spec's
hash; a compile may run on any thread) and makes `TokenMatcher`s. Each step,
`mask_logits` sets the tokens a constrained row's grammar does not allow to
-inf, on those rows only; the engine then feeds the sampled token to the
row's matcher. The matcher lives on the sequence and has accepted exactly its
output tokens, so a recomputed (preempted) sequence keeps it as it is, and a
request resumed on another worker rebuilds it from the tokens it carries.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pagefleet.kernels.transfer import host_to_device
from pagefleet.worker.structured_output import StructuredOutput
from pagefleet.worker.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

# Compiled grammars kept per engine: a JSON schema's masks take from kilobytes to a few
# megabytes, and clients tend to reuse a handful of schemas.
DEFAULT_CACHE_ENTRIES = 64
# Threads one compile may use; the engine thread and the requests' own threads share
# the cores, so more would only steal from the step.
COMPILE_THREADS = 2

# xgrammar's messages start with "[time] /path/file.cc:123: " (and sometimes a failed
# check's condition): the client needs the rest.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


class GrammarError(ValueError):
    """A structured-output spec the grammar engine refuses; the message names the problem."""


class TokenMatcher:
    """Where one sequence is in its grammar: the tokens allowed next, and whether it ended."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (the state unchanged) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and its end (the model's end token) accepted."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next step into `bitmask[row]`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fork(self) -> TokenMatcher:
        """An independent copy in the same state (another completion of the request)."""
        return TokenMatcher(self._matcher.fork())


class Grammars:
    """One model's grammar compiler and cache of compiled structured-output specs.

    Thread-safe: `compile` may run off the engine thread (the async engine
    compiles a new spec in a worker thread before the request reaches the
    step), and the engine's later lookup is then a cache hit.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self.compiles = 0  # how many specs were compiled (cache misses)

    def _grammar_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        # Built on first use: an engine that never sees a structured request pays nothing.
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise GrammarError("structured output needs a tokenizer; this model has none")
                info = tokenizer_info(self._tokenizer, self._vocab_size, self._stop_token_ids)
                # Our LRU is the cache: xgrammar's own would hold a second copy.
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=COMPILE_THREADS, cache_enabled=False
                )
            return self._compiler

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (compiled on the first call; GrammarError if it cannot be)."""
        key = spec.key
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        compiler = self._grammar_compiler()
        # Outside the lock: another spec's lookup need not wait for this compile.
        compiled = _compile(compiler, spec)
        _check_not_empty(compiled, spec)
        with self._lock:
            self.compiles += 1
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self._max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput, accepted: Sequence[int] = ()) -> TokenMatcher:
        """A fresh matcher for `spec` that has accepted `accepted` (the output so far of a
        resumed request); GrammarError when the grammar does not allow those tokens."""
        import xgrammar as xgr

        compiled = self.compile(spec)
        # Without a stop token the matcher ends as soon as the grammar is complete.
        matcher = TokenMatcher(
            xgr.GrammarMatcher(compiled, terminate_without_stop_token=not self._stop_token_ids)
        )
        for pos, token in enumerate(accepted):
            if not matcher.accept(token):
                raise GrammarError(
                    f"output token {token} at position {pos} does not follow the {spec.kind} "
                    "grammar: the request cannot resume"
                )
        return matcher

    def __len__(self) -> int:
        with self._lock:
            return len(self._compiled)


def tokenizer_info(
    tokenizer: Any, vocab_size: int | None, stop_token_ids: Sequence[int] | None
) -> xgr.TokenizerInfo:
    """xgrammar's view of a tokenizer: ours, or an HF one (`TokenizerInfo.from_huggingface`).

    For ours, the fast-tokenizer branch of `from_huggingface` (which only takes a
    transformers class): the vocabulary by id, and the vocabulary's encoding and
    prefix space read from tokenizer.json, or from the vocabulary itself where the
    two disagree. xgrammar's two detectors are private (pinned to 0.2 in
    pyproject.toml); tests/test_tokenizer.py checks the result equals
    `from_huggingface`'s on the HF tokenizer, masks included.
    """
    import xgrammar as xgr

    stops = list(stop_token_ids) if stop_token_ids else None
    if not isinstance(tokenizer, Tokenizer):
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops
        )
    vocab = tokenizer.get_vocab()
    size = vocab_size or max(len(vocab), max(vocab.values()) + 1)
    encoded = [""] * size
    for token, token_id in vocab.items():
        if token_id < size:
            encoded[token_id] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_tokenizer.to_str())
    vocab_type, add_prefix_space = metadata["vocab_type"], metadata["add_prefix_space"]
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != vocab_type:
        vocab_type, add_prefix_space = from_vocab, _prefix_space_on_encoding(tokenizer, from_vocab)
    if stops is None and tokenizer.eos_token_id is not None:
        stops = [tokenizer.eos_token_id]
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=vocab_type,
        vocab_size=size,
        stop_token_ids=stops,
        add_prefix_space=add_prefix_space,
    )


def _prefix_space_on_encoding(tokenizer: Tokenizer, vocab_type: xgr.VocabType) -> bool:
    """Whether encoding "a" gives a token that starts with the vocabulary's space mark."""
    import xgrammar as xgr

    ids = tokenizer.encode("a", add_special_tokens=False)
    first = tokenizer.backend_tokenizer.id_to_token(ids[0]) if ids else None
    mark = "\u2581" if vocab_type == xgr.VocabType.BYTE_FALLBACK else "\u0120"
    return first is not None and first.startswith(mark)


def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    import xgrammar as xgr

    try:
        if spec.json_schema is not None or spec.json_object:
            schema = spec.json_schema if spec.json_schema is not None else '{"type": "object"}'
            # Compact JSON (one space after ',' and ':'): a small model given free
            # whitespace can spend its whole budget on it.
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
            return compiler.compile_grammar(_json_safe(str(grammar)))
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        assert spec.choice is not None
        alternatives = " | ".join(_ebnf_string(c) for c in spec.choice)
        return compiler.compile_grammar(f"root ::= {alternatives}")
    except RuntimeError as exc:
        raise GrammarError(f"the {spec.kind} cannot be compiled: {_xgr_message(exc)}") from None


def _check_not_empty(compiled: xgr.CompiledGrammar, spec: StructuredOutput) -> None:
    import xgrammar as xgr

    # A grammar that allows no first token (e.g. `{"anyOf": []}`) compiles; refused here,
    # it is the client's error, not a request failing at its first step.
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise GrammarError(f"the {spec.kind} allows no output at all")


# xgrammar 0.2.9 writes a string with minLength/maxLength as repetitions of this class,
# which lets raw control characters into the string: JSON parsers refuse the result.
# The replacement leaves them out (as it leaves out quote and backslash; escapes stay
# out too, as in xgrammar's own class): a bare class inside the repetition keeps
# xgrammar's precomputed masks (an alternation with escapes there cost ~10 ms per
# token on SmolLM2's vocabulary against ~10 us).
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_safe(ebnf: str) -> str:
    """xgrammar's EBNF of a JSON schema, its bounded strings without control characters."""
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def _ebnf_string(text: str) -> str:
    """`text` as a literal of xgrammar's EBNF (C-style escapes)."""
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        .replace("\r", "\\r").replace("\t", "\\t")
    )  # fmt: skip
    return f'"{escaped}"'


def _xgr_message(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    first = _XGR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return first.strip()


def mask_logits(logits: torch.Tensor, matchers: Sequence[TokenMatcher | None]) -> torch.Tensor:
    """`logits` ([rows, vocab]) with every token row `i`'s matcher forbids set to -inf.

    Rows without a matcher are not touched (nor is any mask built for them);
    with no matcher at all the tensor comes back as it is. Masks in place
    (pass a copy: the engine passes the rows it indexed out of the forward's
    logits, so the model's own distribution stays there for logprobs).
    """
    constrained = [i for i, m in enumerate(matchers) if m is not None]
    if not constrained:
        return logits
    import xgrammar as xgr  # imported by the first grammar's compile: a dict lookup here
    # Rows of unconstrained sequences stay unfilled: `indices` leaves them alone.
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for i in constrained:
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill(bitmask, i)
    if logits.device.type == "cpu" and logits.dtype != torch.float32:
        logits = logits.to(torch.float32)  # xgrammar's CPU kernel masks float32
    xgr.apply_token_bitmask_inplace(logits, host_to_device(bitmask, logits.device), indices=constrained)
    return logits


__all__ = ["GrammarError", "Grammars", "TokenMatcher", "mask_logits", "tokenizer_info"]
