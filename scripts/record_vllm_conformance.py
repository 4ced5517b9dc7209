"""Record vLLM's answers to the OpenAI requests of tests/realmodel/test_vllm_conformance.py into
tests/realmodel/data/vllm_conformance.json (the test replays each request against tandem and compares).

Every request is greedy (temperature 0) on SmolLM2-135M-Instruct in float32 with max_model_len 2048, so
both servers must give the same tokens. Serve vLLM on the converted model directory (what
`tandem make-demo-model` writes; tests/realmodel/conftest.py) and run this with any Python 3:

    python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --max-model-len 2048 \\
        --port 8321 [--gpu-memory-utilization 0.1 on a small CPU machine]
    python scripts/record_vllm_conformance.py http://127.0.0.1:8321
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "realmodel" / "data" / "vllm_conformance.json"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
OPEN = [*CAPITAL, {"role": "assistant", "content": "The capital of France is"}]
GREEDY = {"temperature": 0}

# (name, route, body): what each behaviour sends.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat plain", "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 10}),
    ("bad_words one token", "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 10, "bad_words": ["Paris"]}),
    ("bad_words two tokens", "/v1/chat/completions",
     {"messages": CAPITAL, "max_tokens": 10, "bad_words": ["capital of"]}),
    ("allowed_token_ids", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 4, "allowed_token_ids": [260, 282, 314, 3575]}),
    ("truncate_prompt_tokens left", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 4, "truncate_prompt_tokens": 3}),
    ("truncate_prompt_tokens right", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 4, "truncate_prompt_tokens": 3,
      "truncation_side": "right"}),
    ("truncate_prompt_tokens -1", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 4, "truncate_prompt_tokens": -1}),
    ("truncate_prompt_tokens beyond the context", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 4, "truncate_prompt_tokens": 5000}),
    ("add_special_tokens false", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 4, "add_special_tokens": False}),
    ("max_tokens beyond the context", "/v1/completions", {"prompt": "word " * 2030, "max_tokens": 100}),
    ("max_tokens beyond max_model_len", "/v1/completions", {"prompt": "Hi", "max_tokens": 4096}),
    ("developer role", "/v1/chat/completions",
     {"messages": [{"role": "developer", "content": "Answer in French."}, *CAPITAL], "max_tokens": 12}),
    ("system role", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "Answer in French."}, *CAPITAL], "max_tokens": 12}),
    ("continue_final_message", "/v1/chat/completions",
     {"messages": OPEN, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 5}),
    ("continue_final_message with add_generation_prompt", "/v1/chat/completions",
     {"messages": OPEN, "continue_final_message": True, "add_generation_prompt": True, "max_tokens": 5}),
    ("chat echo of the open message", "/v1/chat/completions",
     {"messages": OPEN, "continue_final_message": True, "add_generation_prompt": False, "echo": True,
      "max_tokens": 5}),
    ("chat echo of a user message", "/v1/chat/completions", {"messages": CAPITAL, "echo": True, "max_tokens": 5}),
    ("chat_template_kwargs unknown to the template", "/v1/chat/completions",
     {"messages": CAPITAL, "max_tokens": 5, "chat_template_kwargs": {"foo": 1}}),
    ("chat_template_kwargs chat_template", "/v1/chat/completions",
     {"messages": CAPITAL, "max_tokens": 5, "chat_template_kwargs": {"chat_template": "x"}}),
    ("n > 1 greedy completions", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "n": 2}),
    ("n > 1 greedy chat", "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 3, "n": 2}),
    ("temperature above 2", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 3}),
    ("request_id", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "request_id": "conformance-1"}),
    # issue 21, second part: echo, prompt logprobs, token ids, stop_reason, multi-byte cuts, lax numbers
    ("echo with logprobs", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 3, "echo": True, "logprobs": 1}),
    ("echo only (max_tokens 0) with logprobs", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 0, "echo": True, "logprobs": 2}),
    ("echo without logprobs, token prompt", "/v1/completions", {"prompt": [504, 3575, 282], "max_tokens": 2,
                                                                "echo": True}),
    ("echo with return_token_ids", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 2, "echo": True, "logprobs": 0, "return_token_ids": True}),
    ("max_tokens 0 without echo", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
    ("prompt_logprobs completions", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 2, "prompt_logprobs": 2}),
    ("prompt_logprobs chat with return_token_ids", "/v1/chat/completions",
     {"messages": CAPITAL, "max_tokens": 4, "prompt_logprobs": 1, "return_token_ids": True}),
    ("prompt_logprobs with stream", "/v1/completions",
     {"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 1, "stream": True}),
    ("return_tokens_as_token_ids completions", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 3, "logprobs": 2, "return_tokens_as_token_ids": True}),
    ("return_tokens_as_token_ids chat", "/v1/chat/completions",
     {"messages": CAPITAL, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}),
    ("stop_reason null on EOS", "/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 60}),
    ("stop_reason of a stop token id", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 8, "stop_token_ids": [30]}),
    ("length cut inside an emoji, chat logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Reply with three emoji"}], "max_tokens": 20, "logprobs": True,
      "top_logprobs": 2}),
    ("length cut inside an emoji, completions logprobs", "/v1/completions",
     {"prompt": "<|im_start|>user\nReply with three emoji<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 20,
      "logprobs": 1}),
    ("numbers as strings and floats, seed -1", "/v1/completions",
     {"prompt": "The capital of France is", "max_tokens": 4.0, "temperature": "0", "n": "1", "seed": -1,
      "top_p": "1"}),
    ("an integer with a fraction", "/v1/completions", {"prompt": "Hi", "max_tokens": 2.5}),
]


def post(base: str, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(base + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


DETAILS = ("stop_reason", "logprobs", "token_ids", "prompt_logprobs", "prompt_token_ids")


def summary(status: int, body: Any) -> dict[str, Any]:
    """What the test compares: the status; for a success each choice's text, finish and stop reason and,
    when not null, its logprobs, token ids and prompt logprobs (the chat API's prompt_logprobs and
    prompt_token_ids are the response's), the usage, the id, and whether a system_fingerprint is sent.
    tests/realmodel/test_vllm_conformance.py imports this function: both sides are summarised alike."""
    if status != 200:
        return {"status": status}
    choices = []
    for c in body["choices"]:
        choice = {"text": c["text"] if "text" in c else c["message"]["content"], "finish_reason": c["finish_reason"]}
        choice.update({k: c.get(k, body.get(k)) for k in DETAILS if c.get(k, body.get(k)) is not None
                       or k == "stop_reason"})
        choices.append(choice)
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    return {"status": status, "id": body["id"], "choices": choices, "usage": usage,
            "system_fingerprint": body.get("system_fingerprint") is not None}


def main() -> None:
    base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8321"
    with urllib.request.urlopen(base + "/version", timeout=30) as response:
        version = json.loads(response.read()).get("version")
    cases = []
    for name, route, body in CASES:
        request = {**GREEDY, **body}
        cases.append({"name": name, "route": route, "request": request, "vllm": summary(*post(base, route, request))})
        print(name, cases[-1]["vllm"])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"vllm_version": version, "model": "SmolLM2-135M-Instruct float32, max_model_len 2048",
                               "record": "python scripts/record_vllm_conformance.py http://VLLM_HOST:PORT",
                               "cases": cases}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
