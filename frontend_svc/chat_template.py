"""Chat rendering options beyond the messages, with vLLM's semantics (vllm/renderers/hf.py).

`ChatOptions` is what an API may ask of the chat template besides the messages and
`add_generation_prompt`: `continue_final_message` (leave the last message open, so the model continues
it), a per-request `chat_template`, and extra template variables (`chat_template_kwargs`, `documents`,
`reasoning_effort`). `render_chat` applies them with transformers' `apply_chat_template`, which compiles
templates in jinja2's `ImmutableSandboxedEnvironment` (no attribute access to Python internals, no
mutation of the inputs) and caches at most a bounded number of compiled templates.

Invariants (as vLLM):
- A `developer` message is rendered as `system` when the template does not mention the role `developer`
  (current OpenAI SDKs send `developer` where older ones sent `system`); system messages are then merged
  into one, first.
- Extra template variables are passed only when the template reads them (or when they are one of
  transformers' own `apply_chat_template` arguments); `chat_template` and `tokenize` may not be passed
  that way. Request-level options (`add_generation_prompt`, `continue_final_message`, `documents`,
  `reasoning_effort`) win over the same names in `chat_template_kwargs` unless they are None.
- A per-request template is at most `MAX_CHAT_TEMPLATE_CHARS` characters; whether one is accepted at
  all is the API layer's decision (vLLM: only with --trust-request-chat-template).
Failures raise `ChatTemplateError` (a ValueError) with the template's own message.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox

MAX_CHAT_TEMPLATE_CHARS = 64 * 1024
_NOT_PASSABLE = frozenset({"chat_template", "tokenize"})


class ChatTemplateError(ValueError):
    """The chat cannot be rendered: no template, a bad template, or arguments the template refuses."""


@dataclass(frozen=True)
class ChatOptions:
    """How to render a chat besides its messages and `add_generation_prompt` (defaults: the model's own
    template, nothing extra)."""

    continue_final_message: bool = False
    chat_template: str | None = None  # a per-request template; None: the model's
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # chat_template_kwargs, merged
    tools: Sequence[Mapping[str, Any]] | None = None  # OpenAI function definitions, as transformers takes them


def render_chat(hf_tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                options: ChatOptions | None = None) -> str:
    """The rendered chat (text). Raises ChatTemplateError."""
    options = options or ChatOptions()
    template = options.chat_template or hf_tokenizer.chat_template
    if not template:
        raise ChatTemplateError("this model has no chat template; send a text or token_ids prompt")
    if len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise ChatTemplateError(f"the chat template may have at most {MAX_CHAT_TEMPLATE_CHARS} characters, "
                                f"got {len(template)}")
    conversation = [dict(m) for m in messages]
    if any(m.get("role") == "developer" for m in conversation) and not _mentions_developer(template):
        conversation = _developer_as_system(conversation)
    kwargs = template_kwargs(template, options.template_kwargs)
    kwargs.update(add_generation_prompt=add_generation_prompt,
                  continue_final_message=options.continue_final_message)
    if options.tools:
        kwargs["tools"] = [dict(tool) for tool in options.tools]
    try:
        text: str = hf_tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                     **kwargs)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from None
    except ValueError as exc:  # transformers' own refusals (e.g. continue_final_message without content)
        raise ChatTemplateError(str(exc)) from None
    return text


def template_kwargs(template: str, requested: Mapping[str, Any]) -> dict[str, Any]:
    """The requested extra variables that `template` reads or transformers takes (vLLM's
    resolve_chat_template_kwargs); ChatTemplateError for `chat_template` / `tokenize`."""
    refused = _NOT_PASSABLE & requested.keys()
    if refused:
        raise ChatTemplateError(f"Found unexpected chat template kwargs from request: {sorted(refused)}")
    if not requested:
        return {}
    accepted = _template_variables(template) | _hf_template_arguments()
    return {k: v for k, v in requested.items() if k in accepted}


@functools.lru_cache(maxsize=32)
def _template_variables(template: str) -> frozenset[str]:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from None


@functools.lru_cache(maxsize=1)
def _hf_template_arguments() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    signature = inspect.signature(PreTrainedTokenizerBase.apply_chat_template)
    named = (p.name for p in signature.parameters.values()
             if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))
    return frozenset(named) - _NOT_PASSABLE - {"self", "conversation"}


@functools.lru_cache(maxsize=32)
def _mentions_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`developer` -> `system`; then every system message merged into one, first (vLLM's
    _convert_developer_to_system and _consolidate_system_messages)."""
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in conversation]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    contents = [converted[i].get("content") or "" for i in systems]
    merged = {"role": "system", "content": "\n\n".join(c for c in contents if c)}
    return [merged, *(m for m in converted if m["role"] != "system")]
