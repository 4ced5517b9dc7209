"""Anthropic's Messages API on the real model against vLLM's recorded answers, request for request.

tests/realmodel/data/vllm_messages.json holds Messages requests (greedy, SmolLM2-135M-Instruct in float32,
max_model_len 2048) and vLLM 0.32's answers — whole bodies, every SSE event, refusals' statuses — recorded by
scripts/record_vllm_messages.py against `vllm serve --enable-auto-tool-choice --tool-call-parser hermes`.
The session's tandem engine + frontend pair (`--tool-call-parser hermes`; conftest.py `smollm2_pair`) on the
directory vLLM served answers each one; the answers must be the same field for field (ids and the model's
path normalised the recorder's way; the text pieces of consecutive text_delta events may be cut
differently, their order and text may not). The official `anthropic` client reads both forms.

A forced call (tool_choice `tool` or `any`) is where tandem and vLLM 0.32 differ (docs/anthropic.md): vLLM
forces the hermes wrapper through a structural tag, and on this model its recorded answers are a truncated
`<tool_call>` text; tandem constrains the output to the call itself (as vLLM's chat API did before 0.32)
and answers a tool_use block. Those cases check tandem's own answer instead: a get_weather call whose input
matches the tool's schema.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema
import pytest

from frontend_svc.anthropic.errors import error_type
from tests.realmodel.support import SharedPair

pytestmark = pytest.mark.slow

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_messages.json").read_text())
_spec = importlib.util.spec_from_file_location(
    "record_vllm_messages", Path(__file__).resolve().parents[2] / "scripts" / "record_vllm_messages.py")
assert _spec is not None and _spec.loader is not None
recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recorder)
CASES = {c["name"]: c for c in RECORDED["cases"]}
RECORDED_MODEL = RECORDED["cases"][0]["body"]["model"]
FORCED = ("tool_choice tool", "tool_choice tool streamed", "tool_choice any")


@pytest.fixture(scope="module")
def api(smollm2_pair: SharedPair) -> str:
    """The session's SmolLM2 pair served as vLLM served it when the answers were recorded (conftest.py)."""
    return smollm2_pair.url


def served_model(url: str) -> str:
    return str(httpx2.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def answer_of(url: str, case: dict[str, Any], model: str) -> dict[str, Any]:
    """The recorder's form of tandem's answer (the recorder's own request code)."""
    return dict(recorder.call(url, case["route"], {"model": model, **case["request"]}))


def comparable(answer: dict[str, Any], model: str) -> dict[str, Any]:
    """`answer` with the model's name made equal and consecutive text_delta events of a block merged."""
    out = json.loads(json.dumps(answer).replace(json.dumps(model), '"<model>"'))
    if "events" in out:
        merged: list[list[Any]] = []
        for name, data in out["events"]:
            last = merged[-1][1] if merged else None
            if (last is not None and name == merged[-1][0] == "content_block_delta"
                    and data["delta"]["type"] == last["delta"]["type"] == "text_delta" and data["index"] == last["index"]):
                last["delta"]["text"] += data["delta"]["text"]
            else:
                merged.append([name, data])
        out["events"] = merged
    return out


@pytest.mark.parametrize("name", [n for n in CASES if n not in FORCED])
def test_the_same_answer_as_vllm(api: str, name: str) -> None:
    """The same body and events; a refusal: the same status, in Anthropic's error shape (vLLM answers its
    own error types, and FastAPI's validation errors in OpenAI's shape: docs/anthropic.md)."""
    case = CASES[name]
    model = served_model(api)
    got = comparable(answer_of(api, case, model), model)
    expected = comparable({k: case[k] for k in ("status", "body", "events") if k in case}, RECORDED_MODEL)
    if expected["status"] != 200:
        assert got["status"] == expected["status"], got
        assert got["body"]["type"] == "error" and got["body"]["error"]["type"] == error_type(got["status"])
        return
    assert got == expected


@pytest.mark.parametrize("name", FORCED)
def test_a_forced_call_is_a_tool_use_block_matching_the_schema(api: str, name: str) -> None:
    case = CASES[name]
    answer = answer_of(api, case, served_model(api))
    assert answer["status"] == 200
    if "events" in answer:
        starts = [data["content_block"] for event, data in answer["events"] if event == "content_block_start"]
        pieces = [data["delta"]["partial_json"] for event, data in answer["events"]
                  if event == "content_block_delta" and data["delta"]["type"] == "input_json_delta"]
        [block] = starts
        assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {})
        tool_input = json.loads("".join(pieces))
        stop_reason = answer["events"][-2][1]["delta"]["stop_reason"]
    else:
        [block] = answer["body"]["content"]
        assert (block["type"], block["name"]) == ("tool_use", "get_weather")
        tool_input, stop_reason = block["input"], answer["body"]["stop_reason"]
    jsonschema.validate(tool_input, recorder.WEATHER_TOOL["input_schema"])
    assert stop_reason == "tool_use"



def test_the_anthropic_client_reads_both_forms(api: str) -> None:
    c = anthropic.Anthropic(base_url=api, api_key="none", max_retries=0, timeout=300)
    model = served_model(api)
    plain = CASES["plain"]
    expected = plain["body"]["content"][0]["text"]
    request: Any = {k: v for k, v in plain["request"].items() if k != "temperature"}
    whole = c.messages.create(model=model, extra_body={"temperature": 0}, **request)
    assert [b.text for b in whole.content if b.type == "text"] == [expected] and whole.stop_reason == "end_turn"
    with c.messages.stream(model=model, extra_body={"temperature": 0}, **request) as stream:
        assert "".join(stream.text_stream) == expected
        final = stream.get_final_message()
    assert final.usage.output_tokens == whole.usage.output_tokens == plain["body"]["usage"]["output_tokens"]
    counted = c.messages.count_tokens(model=model, messages=request["messages"])
    assert counted.input_tokens == CASES["count_tokens"]["body"]["input_tokens"] == whole.usage.input_tokens
