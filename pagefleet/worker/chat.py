"""Chat conversations to prompts: the model's own chat template, one rule for every front.

`LLM.chat`, `pagefleet generate --chat` and the OpenAI `/v1/chat/completions`
all call `chat_prompt`, so a conversation becomes the same tokens whichever
way it arrives (and hits the same prefix-cache blocks).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = Mapping[str, Any]


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


def chat_prompt(
    messages: Sequence[Message], tokenizer: Any, tools: Sequence[ChatTool] = ()
) -> str | list[int]:
    """The prompt of a conversation (OpenAI-shaped `{"role", "content"}` messages).

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
    plain = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in messages]
    if tools and not template_takes_tools(tokenizer):
        raise ChatTemplateError(
            "tools are not supported by this model: its chat template does not render tools"
            if getattr(tokenizer, "chat_template", None)
            else "tools are not supported by this model: it has no chat template"
        )
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                plain, tools=[t.to_template() for t in tools] or None, tokenize=False,
                add_generation_prompt=True,
            )  # fmt: skip
        except Exception as exc:  # templates raise their own errors (e.g. role order)
            raise ChatTemplateError(f"messages do not fit the model's chat template: {exc}") from exc
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
