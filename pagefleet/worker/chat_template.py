"""Chat templates rendered as transformers renders them, without transformers.

A chat template is a jinja2 template from the checkpoint (untrusted code), so
it runs in transformers' sandbox: an `ImmutableSandboxedEnvironment` with
`trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension; its `tojson`
(no HTML escaping), `raise_exception`, `strftime_now`, `dict` and a
`namespace` that refuses underscore-prefixed names; the `{% generation %}`
tag. Every value the template sees is rebuilt from plain JSON types first.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """The text of `messages` by the template `source`, with `tools` (JSON schemas) and
    `variables` (the special tokens, and any more the caller passes) as transformers'
    `apply_chat_template` passes them. Raises the template's jinja2 errors."""
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    # transformers drops keys set to None: many templates render a present None as "None".
    plain = _plain([{k: v for k, v in dict(m).items() if v is not None} for m in messages])
    return compile_chat_template(source).render(
        messages=_alias_reasoning_fields(plain),
        tools=_plain(None if tools is None else list(tools)),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **_plain(dict(variables)),
    )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training);
    renders its body as it is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without the type itself (no attribute tricks)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace`, refusing underscore-prefixed attributes."""

    # No `self` parameter, as in jinja2's Namespace: `namespace(self=...)` must work.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    # Not jinja2's own: that one escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in transformers' sandbox (compiled once per text)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


# The names a message's reasoning comes under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning_fields(messages: list[Any]) -> list[Any]:
    aliased = []
    for message in messages:
        if isinstance(message, dict):
            reasoning = next(
                (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
            )
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, anything else a placeholder naming its type:
    what a sandboxed template may see (transformers' `_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


__all__ = ["compile_chat_template", "render_chat_template"]
