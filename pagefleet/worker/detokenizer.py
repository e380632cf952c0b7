"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE: one character can span
several tokens, and a token's text can depend on its neighbours. We decode a
small sliding window instead (prefix/read offsets, as TGI and vLLM do) and
emit only text that is final: no trailing replacement character, and no
suffix that could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded as left context for the first generated tokens
# (some tokenizers render a token differently at the start of a text).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text, one token at a time, and spots stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        resumed_token_ids: Sequence[int] = (),
    ) -> None:
        """`resumed_token_ids`: output an earlier attempt of the request streamed (a request
        resumed on another worker). They are replayed as output, handing out their text as
        that attempt did, so `take_delta` goes on from exactly the text the client has:
        text held back then (a partial character, or what may begin a stop string) comes
        now, and a stop string that straddles the resumption still matches."""
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self.text = ""  # generated text so far, cut before a matched stop string
        self.stopped = False  # a stop string matched
        self._emitted = 0  # characters of `text` already handed out
        for token_id in resumed_token_ids:
            self.add_token(token_id)
            self.take_delta()

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def add_token(self, token_id: int) -> bool:
        """Append one generated token; returns True when a stop string now matched."""
        if self.stopped:
            return True
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means an incomplete UTF-8 sequence: wait for the next token.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        match = min(
            (i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0),
            default=-1,
        )
        if match >= 0:
            self.text = self.text[:match]
            self.stopped = True
        return self.stopped

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    @property
    def emitted_text(self) -> str:
        """The text handed out by `take_delta` so far."""
        return self.text[: self._emitted]

    def take_delta(self, final: bool = False) -> str:
        """Text that became final since the last call (everything left when `final`)."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
