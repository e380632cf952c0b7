"""Chat conversations to prompts: the model's own chat template, one rule for every front.

`LLM.chat`, `pagefleet generate --chat` and the OpenAI `/v1/chat/completions`
all call `chat_prompt`, so a conversation becomes the same tokens whichever
way it arrives (and hits the same prefix-cache blocks).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = Mapping[str, Any]

# The roles a chat message may have (OpenAI's, less the deprecated "function"). A model
# takes those its chat template knows (`template_roles`).
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# The keys of a message besides role and content that go to the chat template as they are
# (as vLLM passes them): the speaker's name, and the call a tool message answers.
TEMPLATE_MESSAGE_KEYS = ("name", "tool_call_id")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered for this model; the message says why."""


@dataclass(frozen=True)
class ChatTool:
    """A function the model may be told about (OpenAI's `tools[].function`);
    `parameters` is its JSON schema as JSON text."""

    name: str
    description: str | None = None
    parameters: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The shape HF chat templates read: `{"type": "function", "function": {...}}`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools (its source reads `tools`)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def template_roles(tokenizer: Any) -> tuple[str, ...]:
    """The roles this model's chat messages may have.

    Without a chat template, every role of `CHAT_ROLES` (the plain format
    writes the role's name). With one, `user` and `assistant`, and each of
    `system`, `tool` and `developer` that the template's source names as a
    string (`'tool'`, `"developer"`): a template that never tests for a role
    would render it as an unknown speaker the model was not trained on.
    """
    template = getattr(tokenizer, "chat_template", None)
    return _roles_of(template) if isinstance(template, str) and template else CHAT_ROLES


@functools.lru_cache(maxsize=64)
def _roles_of(template: str) -> tuple[str, ...]:
    named = {r for r in CHAT_ROLES if re.search(rf"""['"]{r}['"]""", template)}
    return tuple(r for r in CHAT_ROLES if r in ("user", "assistant") or r in named)


def chat_prompt(
    messages: Sequence[Message], tokenizer: Any, tools: Sequence[ChatTool] = ()
) -> str | list[int]:
    """The prompt of a conversation (OpenAI-shaped `{"role", "content"}` messages).

    Each message's role must be one of the model's (`template_roles`); its
    `name` and `tool_call_id`, when set, go to the chat template as they are
    (a model without a template refuses them, as it refuses `tools`).

    `tools` go to the chat template (HF's `apply_chat_template(tools=...)`); a
    model whose template does not render tools (or that has none) refuses them
    with `ChatTemplateError`, rather than silently leaving them out.

    With a chat template (SmolLM2, any instruct model) the result is the
    template's text with the generation prompt, as token ids, so the special
    tokens the template writes are not added a second time by `encode`; the
    model then ends its turn with its end-of-turn token, which the engine
    stops at (it is the model's EOS). Without a template (the built-in tiny
    model), one line per message, ``"{role}: {content}\\n"``, then
    ``"assistant:"`` for the model to continue.
    """
    if tokenizer is None:
        raise ChatTemplateError("this model has no tokenizer: chat needs one (send token ids)")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    roles = template_roles(tokenizer)
    plain: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if m["role"] not in roles:
            raise ChatTemplateError(
                f"messages[{i}].role {m['role']!r} is not supported by this model (its chat "
                f"template does not name it); allowed roles: {', '.join(roles)}"
            )
        message = {"role": str(m["role"]), "content": str(m.get("content") or "")}
        for key in TEMPLATE_MESSAGE_KEYS:
            if m.get(key) is None:
                continue
            if not has_template:
                raise ChatTemplateError(
                    f"messages[{i}].{key} is not supported by this model: it has no chat template"
                )
            message[key] = str(m[key])
        plain.append(message)
    if tools and not template_takes_tools(tokenizer):
        raise ChatTemplateError(
            "tools are not supported by this model: its chat template does not render tools"
            if getattr(tokenizer, "chat_template", None)
            else "tools are not supported by this model: it has no chat template"
        )
    if has_template:
        try:
            text = tokenizer.apply_chat_template(
                plain, tools=[t.to_template() for t in tools] or None, tokenize=False,
                add_generation_prompt=True,
            )  # fmt: skip
        except Exception as exc:  # templates raise their own errors (e.g. role order)
            raise ChatTemplateError(f"messages do not fit the model's chat template: {exc}") from exc
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
