"""Chat rendering options (frontend_svc/chat_template.py) against transformers' own apply_chat_template:
continue_final_message, developer -> system, template variables, and per-request templates (sandboxed,
bounded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from frontend_svc.chat_template import (
    MAX_CHAT_TEMPLATE_CHARS,
    ChatOptions,
    ChatTemplateError,
    render_chat,
    template_kwargs,
)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


QUESTION = [{"role": "user", "content": "What is the sea?"}, {"role": "assistant", "content": "The sea is"}]


def test_continue_final_message_leaves_the_last_message_open(hf: Any) -> None:
    text = render_chat(hf, QUESTION, False, ChatOptions(continue_final_message=True))
    assert text == hf.apply_chat_template(QUESTION, tokenize=False, continue_final_message=True)
    assert text.endswith("The sea is") and text != render_chat(hf, QUESTION, False)


def test_developer_becomes_system_unless_the_template_knows_it(hf: Any) -> None:
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render_chat(hf, developer, True) == hf.apply_chat_template(system, tokenize=False,
                                                                      add_generation_prompt=True)
    late = [{"role": "system", "content": "A."}, {"role": "user", "content": "hi"},
            {"role": "developer", "content": "B."}]
    merged = [{"role": "system", "content": "A.\n\nB."}, {"role": "user", "content": "hi"}]
    assert render_chat(hf, late, True) == hf.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
    knows = "{% for m in messages %}{% if m['role'] == 'developer' %}D:{% endif %}{{ m['content'] }};{% endfor %}"
    assert render_chat(hf, developer, False, ChatOptions(chat_template=knows)) == "D:Be brief.;hi;"


def test_template_kwargs_are_those_the_template_reads(hf: Any) -> None:
    assert template_kwargs("{{ foo }}", {"foo": 1, "bar": 2}) == {"foo": 1}
    assert "documents" in template_kwargs("{{ x }}", {"documents": []})  # one of transformers' arguments
    with pytest.raises(ChatTemplateError, match="chat_template"):
        template_kwargs("{{ x }}", {"chat_template": "evil"})
    text = render_chat(hf, QUESTION, False, ChatOptions(chat_template="{{ greeting }}|{{ messages[0]['content'] }}",
                                                        template_kwargs={"greeting": "ahoy", "unused": 1}))
    assert text == "ahoy|What is the sea?"


def test_a_request_template_is_sandboxed_and_bounded(hf: Any) -> None:
    assert render_chat(hf, QUESTION, False, ChatOptions(chat_template="{{ messages[1]['content'] }}")) == "The sea is"
    with pytest.raises(ChatTemplateError):  # the sandbox refuses Python internals
        render_chat(hf, QUESTION, False, ChatOptions(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(ChatTemplateError, match="at most"):
        render_chat(hf, QUESTION, False, ChatOptions(chat_template="x" * (MAX_CHAT_TEMPLATE_CHARS + 1)))
    with pytest.raises(ChatTemplateError):
        render_chat(hf, QUESTION, False, ChatOptions(chat_template="{% for %}"))
