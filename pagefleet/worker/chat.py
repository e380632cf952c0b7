"""Chat conversations to prompts: the model's own chat template, one rule for every front.

`LLM.chat`, `pagefleet generate --chat` and the OpenAI `/v1/chat/completions`
all call `chat_prompt`, so a conversation becomes the same tokens whichever
way it arrives (and hits the same prefix-cache blocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The messages cannot be rendered for this model; the message says why."""


def chat_prompt(messages: Sequence[Message], tokenizer: Any) -> str | list[int]:
    """The prompt of a conversation (OpenAI-shaped `{"role", "content"}` messages).

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
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # templates raise their own errors (e.g. role order)
            raise ChatTemplateError(f"messages do not fit the model's chat template: {exc}") from exc
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
