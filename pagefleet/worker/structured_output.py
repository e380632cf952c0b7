"""What a request's output must match: a JSON schema, any JSON object, a regex or a choice.

`StructuredOutput` is the typed spec every front builds and `SamplingParams`
carries; it only checks what is cheap (one kind set, JSON text that parses,
a size bound). Whether the grammar engine can compile it is the worker's
question (`pagefleet.worker.grammar`), answered once per spec.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

# The most bytes a spec may have (schema text, regex, or the choices together): the
# grammar is compiled on the worker, and its compile time and mask tables grow with it.
MAX_STRUCTURED_BYTES = 64 * 1024

KINDS = ("json_schema", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's generated text must follow; exactly one field is set.

    `json_schema`: a JSON schema (a dict, or its JSON text; stored as compact
    text, the properties in the client's order, which the output follows).
    `json_object`: any JSON object. `regex`: the whole output fullmatches it
    (xgrammar's regex dialect, as vLLM's). `choice`: the output is exactly one
    of these strings. At most `MAX_STRUCTURED_BYTES` (64 KiB) of spec.

    A completion that ends by itself (finish_reason "stop", the grammar
    complete and the model's end token sampled) always matches; one cut by
    `max_tokens`, a stop string or a stop token need not.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        schema: Any = self.json_schema
        if schema is not None and not isinstance(schema, str):
            if not isinstance(schema, dict):
                raise ValueError(
                    f"json_schema must be a JSON object (a dict or its text), got {type(schema).__name__}"
                )
            schema = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        elif isinstance(schema, str):
            schema = _compact_schema(schema)
        object.__setattr__(self, "json_schema", schema)
        if self.choice is not None:
            if isinstance(self.choice, str):
                raise ValueError("choice must be a list of strings, got a string")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a boolean, got {self.json_object!r}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"regex must be a string, got {type(self.regex).__name__}")
        given = [name for name in KINDS if self._is_set(name)]
        if len(given) != 1:
            raise ValueError(
                "structured output takes exactly one of json_schema, json_object, regex, choice; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.regex == "":
            raise ValueError("regex is empty")
        if self.choice is not None and not self.choice:
            raise ValueError("choice is empty: at least one string is required")
        if self.choice is not None and any(not isinstance(c, str) or c == "" for c in self.choice):
            raise ValueError(f"choice must be a list of non-empty strings, got {list(self.choice)!r}")
        size = len(self.spec.encode("utf-8"))
        if size > MAX_STRUCTURED_BYTES:
            raise ValueError(
                f"the structured output {self.kind} is {size} bytes; at most "
                f"{MAX_STRUCTURED_BYTES} bytes (64 KiB) are allowed"
            )

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and value is not False

    @property
    def kind(self) -> str:
        """Which field is set: "json_schema", "json_object", "regex" or "choice"."""
        return next(name for name in KINDS if self._is_set(name))

    @property
    def spec(self) -> str:
        """The spec as one string (the choices as a JSON list): what the cache key hashes."""
        if self.json_schema is not None:
            return self.json_schema
        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return json.dumps(list(self.choice), ensure_ascii=False)
        return ""

    @property
    def key(self) -> str:
        """A hash of kind and spec: the compiled grammar's cache key on a worker."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()


def _compact_schema(text: str) -> str:
    if len(text) > 4 * MAX_STRUCTURED_BYTES:  # parsing a huge text only to refuse it costs time
        raise ValueError(
            f"the structured output json_schema is {len(text)} characters; at most "
            f"{MAX_STRUCTURED_BYTES} bytes (64 KiB) are allowed"
        )
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"json_schema must be a JSON object, got {type(parsed).__name__}")
    return json.dumps(parsed, separators=(",", ":"), ensure_ascii=False)
