"""OpenAI / vLLM structured-output fields -> the contract's `StructuredOutputs` (the engine enforces it).

How the fields map (vLLM's semantics, docs/openai.md):
- `response_format: {"type": "text"}` (or absent): no constraint.
- `response_format: {"type": "json_object"}`: any JSON object (vLLM's `structured_outputs.json_object`).
- `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`: the schema
  (vLLM's `structured_outputs.json`). `strict` is accepted either way: the engine always enforces the
  schema, so every output validates (strict: true is what a client gets).
- vLLM's `structured_outputs`: `json` (a schema, object or JSON text), `json_object`, `regex`, `choice`,
  `grammar` (EBNF), `structural_tag` (JSON text); exactly one.
- Tool calling with `tool_choice` "required" or a named function is a JSON schema too (tools.py).
At most one source may constrain a request: two of them is a 400 naming the second, never a silent pick.
"""

from __future__ import annotations

import json
from typing import Any

from frontend_svc.openai import protocol as p
from shared_runtime.contract import StructuredOutputs
from shared_runtime.violations import ValidationError


def schema_text(schema: dict[str, Any] | str) -> str:
    """A JSON schema as compact JSON text; its property order (the output's order) is kept."""
    return schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def from_response_format(fmt: p.ResponseFormat | None) -> StructuredOutputs | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ValidationError.single("response_format.json_schema.schema",
                                     "response_format json_schema needs json_schema.schema")
    return StructuredOutputs(json=schema_text(fmt.json_schema.schema_))


def from_vllm(params: p.StructuredOutputsParams | None) -> StructuredOutputs | None:
    """vLLM's `structured_outputs`; the contract checks that exactly one constraint is set."""
    if params is None:
        return None
    return StructuredOutputs(
        json=schema_text(params.json_) if params.json_ is not None else None,
        json_object=bool(params.json_object),
        regex=params.regex,
        choice=params.choice,
        grammar=params.grammar,
        structural_tag=params.structural_tag,
    )


def request_constraint(request: p.CompletionRequest | p.ChatCompletionRequest,
                       tool_constraint: StructuredOutputs | None = None) -> StructuredOutputs | None:
    """The one constraint of a request (response_format, structured_outputs or tool_choice); 400 when
    more than one asks for one."""
    sources = [
        ("response_format", from_response_format(request.response_format)),
        ("structured_outputs", from_vllm(request.structured_outputs)),
        ("tool_choice", tool_constraint),
    ]
    given = [(name, constraint) for name, constraint in sources if constraint is not None]
    if len(given) > 1:
        raise ValidationError.single(given[1][0], f"only one of response_format, structured_outputs and a "
                                                  f"required/named tool_choice may constrain the output; "
                                                  f"{given[0][0]} already does")
    return given[0][1] if given else None
