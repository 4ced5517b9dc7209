"""Record vLLM's answers to the Responses API requests of tests/realmodel/test_responses_served.py into
tests/realmodel/data/vllm_responses.json (the test replays each request against tandem and compares).

Every request is greedy (temperature 0) on SmolLM2-135M-Instruct in float32 with max_model_len 2048. A
case records the status and the whole body (non-streaming) or every SSE event (streaming), with what
differs between any two runs made comparable by `normalise` (ids, timestamps), which the test applies to
tandem's answers too. Serve vLLM as scripts/record_vllm_conformance.py says, then:

    python scripts/record_vllm_responses.py http://127.0.0.1:8322
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "realmodel" / "data" / "vllm_responses.json"
QUESTION = "What is the capital of France?"
CAPITAL = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0}

# (name, method, route, body): what each behaviour sends.
CASES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("string input", "POST", "/v1/responses", {"input": QUESTION, "max_output_tokens": 12}),
    ("string input streamed", "POST", "/v1/responses", {"input": QUESTION, "max_output_tokens": 12, "stream": True}),
    ("instructions and messages", "POST", "/v1/responses",
     {"instructions": "Answer in French.", "input": CAPITAL, "max_output_tokens": 12}),
    ("input items with parts", "POST", "/v1/responses",
     {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
      "max_output_tokens": 12}),
    ("multi-turn", "POST", "/v1/responses",
     {"input": [*CAPITAL, {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}], "max_output_tokens": 12}),
    ("partial assistant message is continued", "POST", "/v1/responses",
     {"input": [*CAPITAL, {"type": "message", "role": "assistant", "status": "in_progress",
                           "content": [{"type": "output_text", "text": "The capital of France is"}]}],
      "max_output_tokens": 6}),
    ("runs to the end of the answer", "POST", "/v1/responses", {"input": "Say hi.", "max_output_tokens": 64}),
    ("runs to the end streamed", "POST", "/v1/responses",
     {"input": "Say hi.", "max_output_tokens": 64, "stream": True}),
    ("metadata, user, top_p and penalties echoed", "POST", "/v1/responses",
     {"input": QUESTION, "max_output_tokens": 4, "metadata": {"k": "v"}, "user": "u-1", "top_p": 0.5,
      "presence_penalty": 0.5, "frequency_penalty": 0.25}),
    ("text.format json_schema; reasoning, service_tier, parallel_tool_calls echoed", "POST", "/v1/responses",
     {"input": "Give a JSON object with a.", "max_output_tokens": 20, "reasoning": {"effort": "low"},
      "service_tier": "default", "parallel_tool_calls": False,
      "text": {"format": {"type": "json_schema", "name": "s", "strict": True, "schema": {
          "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}),
    ("an empty answer", "POST", "/v1/responses", {"input": QUESTION, "max_output_tokens": 12, "stop": ["The"]}),
    ("an empty answer streamed", "POST", "/v1/responses",
     {"input": QUESTION, "max_output_tokens": 12, "stop": ["The"], "stream": True}),
    ("max_output_tokens beyond max_model_len", "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 4096}),
    ("request_id names the response", "POST", "/v1/responses",
     {"input": "Hi", "max_output_tokens": 2, "request_id": "resp_conformance-1"}),
    ("unknown previous_response_id", "POST", "/v1/responses",
     {"input": "Hi", "max_output_tokens": 2, "previous_response_id": "resp_nope"}),
    ("background without a store", "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "background": True}),
    ("wrong model", "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2, "model": "nope"}),
    ("retrieve unknown", "GET", "/v1/responses/resp_nope", None),
    ("cancel unknown", "POST", "/v1/responses/resp_nope/cancel", None),
    # the same messages through chat completions: the Responses text must equal the chat text
    ("chat twin of string input", "POST", "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 12}),
    ("chat twin of instructions and messages", "POST", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "Answer in French."}, *CAPITAL], "max_tokens": 12}),
]

_IDS = re.compile(r"^(resp|msg|chatcmpl)_?-?[0-9a-f]{8,}")


def normalise(value: Any) -> Any:
    """ids and timestamps (different on every run) replaced by their kind; everything else kept."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in ("created_at", "created"):
                out[key] = "<time>"
            elif key in ("id", "item_id") and isinstance(item, str) and _IDS.match(item):
                out[key] = f"<{item.split('_')[0].split('-')[0]} id>"
            else:
                out[key] = normalise(item)
        return out
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


def events(raw: str) -> list[dict[str, Any]]:
    """An SSE body as [{"event": name, "data": json}] in order."""
    out = []
    for block in raw.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        out.append({"event": fields.get("event"), "data": json.loads(fields["data"])})
    return out


def call(base: str, method: str, route: str, body: dict[str, Any] | None) -> dict[str, Any]:
    data = None if body is None else json.dumps({**GREEDY, **body}).encode()
    request = urllib.request.Request(base + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            raw = response.read().decode()
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return {"status": response.status, "events": normalise(events(raw))}
            return {"status": response.status, "body": normalise(json.loads(raw))}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": normalise(json.loads(exc.read() or b"null"))}


def main() -> None:
    base = sys.argv[1].rstrip("/")
    version = json.loads(urllib.request.urlopen(base + "/version", timeout=30).read())["version"]
    cases = [{"name": name, "method": method, "route": route, "request": None if body is None else {**GREEDY, **body},
              "vllm": call(base, method, route, body)} for name, method, route, body in CASES]
    record = {"vllm_version": version, "model": "SmolLM2-135M-Instruct (float32, max_model_len 2048)",
              "regenerate": "python scripts/record_vllm_responses.py http://127.0.0.1:8322", "cases": cases}
    OUT.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(cases)} cases")


if __name__ == "__main__":
    main()
