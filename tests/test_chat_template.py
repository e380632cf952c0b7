"""Chat messages to prompts (`pagefleet.worker.chat`): the roles each model takes and the
message keys that reach its chat template, on the tiny model (no template) and SmolLM2's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from smollm2 import smollm2_dir

from pagefleet.worker.chat import ChatTemplateError, chat_prompt, template_roles
from pagefleet.worker.tiny_model import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


def _with_template(tokenizer: Any, template: str) -> Any:
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = template
    return copied


def test_a_model_without_a_template_takes_every_openai_role(tiny_tokenizer: Any) -> None:
    assert template_roles(tiny_tokenizer) == ("system", "user", "assistant", "tool", "developer")
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "tool", "content": "42"}]
    assert chat_prompt(messages, tiny_tokenizer) == "developer: Be brief.\ntool: 42\nassistant:"


def test_smollm2s_template_takes_system_user_and_assistant(smollm2_tokenizer: Any) -> None:
    assert template_roles(smollm2_tokenizer) == ("system", "user", "assistant")


@pytest.mark.parametrize("role", ["tool", "developer"])
def test_a_role_smollm2s_template_does_not_name_is_refused_naming_its_roles(
    smollm2_tokenizer: Any, role: str
) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": role, "content": "x"}]
    with pytest.raises(
        ChatTemplateError,
        match=rf"messages\[1\].role '{role}' is not supported by this model .* "
        r"allowed roles: system, user, assistant$",
    ):
        chat_prompt(messages, smollm2_tokenizer)


def test_a_template_that_names_tool_and_developer_takes_them(tiny_tokenizer: Any) -> None:
    tokenizer = _with_template(
        tiny_tokenizer,
        "{% for m in messages %}{% if m.role == 'tool' %}[tool] {% elif m.role == \"developer\" %}"
        "[dev] {% endif %}{{ m.content }}\n{% endfor %}",
    )
    assert template_roles(tokenizer) == ("user", "assistant", "tool", "developer")
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "tool", "content": "42"}]
    assert tokenizer.decode(chat_prompt(messages, tokenizer)) == "[dev] Be brief.\n[tool] 42\n"


def test_name_and_tool_call_id_reach_the_chat_template(tiny_tokenizer: Any) -> None:
    tokenizer = _with_template(
        tiny_tokenizer,
        "{% for m in messages %}{% if m.role == 'tool' %}tool {{ m.tool_call_id }}"
        "{% else %}{{ m.role }} {{ m.name }}{% endif %}: {{ m.content }}\n{% endfor %}",
    )
    messages = [
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    assert tokenizer.decode(chat_prompt(messages, tokenizer)) == "user alice: Hi\ntool call_1: 42\n"


@pytest.mark.parametrize("key", ["name", "tool_call_id"])
def test_name_and_tool_call_id_are_refused_by_a_model_without_a_template(
    tiny_tokenizer: Any, key: str
) -> None:
    with pytest.raises(
        ChatTemplateError, match=rf"messages\[0\].{key} is not supported by this model: it has no chat template"
    ):
        chat_prompt([{"role": "user", "content": "Hi", key: "x"}], tiny_tokenizer)
