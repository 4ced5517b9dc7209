"""The Responses API on the real model against vLLM's recorded answers, request for request.

tests/realmodel/data/vllm_responses.json holds Responses requests (greedy, SmolLM2-135M-Instruct in float32,
max_model_len 2048) and vLLM's answers — whole bodies, every SSE event, error statuses — recorded by
scripts/record_vllm_responses.py, plus the chat completions of the same messages. tandem must give the same
answer field for field (ids, timestamps and the model's path normalised the recorder's way; the text pieces
of consecutive output_text.delta events may be cut differently, their order and text may not). The official
`openai` client reads both forms.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from tests.realmodel.support import SharedPair

pytestmark = pytest.mark.slow

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_responses.json").read_text())
_spec = importlib.util.spec_from_file_location(
    "record_vllm_responses", Path(__file__).resolve().parents[2] / "scripts" / "record_vllm_responses.py")
assert _spec is not None and _spec.loader is not None
recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recorder)
CASES = {c["name"]: c for c in RECORDED["cases"]}


def comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """`answer` with the served model's name and prompt-cache hits (a fresh vLLM had none) made equal, and
    consecutive output_text.delta events merged (sequence numbers renumbered)."""
    text = json.dumps(answer)
    for name in (RECORDED_MODEL, SERVED_MODEL[0]):
        text = text.replace(json.dumps(name), '"<model>"')
    out = json.loads(text)
    for usage in _usages(out):
        usage["input_tokens_details"]["cached_tokens"] = 0
    if "events" in out:
        merged: list[dict[str, Any]] = []
        for event in out["events"]:
            if merged and event["event"] == merged[-1]["event"] == "response.output_text.delta":
                merged[-1]["data"]["delta"] += event["data"]["delta"]
            else:
                merged.append(event)
        for number, event in enumerate(merged):
            event["data"]["sequence_number"] = number
        out["events"] = merged
    return out


def _usages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        found = [value["usage"]] if isinstance(value.get("usage"), dict) and "input_tokens" in value["usage"] else []
        return found + [u for k, v in value.items() if k != "usage" for u in _usages(v)]
    if isinstance(value, list):
        return [u for v in value for u in _usages(v)]
    return []


@pytest.fixture(scope="module")
def api(smollm2_pair: SharedPair) -> str:
    """The session's SmolLM2 pair served as vLLM served it when the answers were recorded (conftest.py)."""
    return smollm2_pair.url


RECORDED_MODEL = CASES["string input"]["vllm"]["body"]["model"]
SERVED_MODEL: list[str] = [""]


def answer_of(url: str, case: dict[str, Any]) -> dict[str, Any]:
    route, body = case["route"], case["request"]
    with httpx2.stream(case["method"], url + route, json=body, timeout=300) as response:
        raw = response.read().decode()
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return {"status": response.status_code, "events": recorder.normalise(recorder.events(raw))}
        return {"status": response.status_code, "body": recorder.normalise(json.loads(raw))}


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("chat twin")])
def test_the_same_answer_as_vllm(api: str, name: str) -> None:
    SERVED_MODEL[0] = httpx2.get(f"{api}/v1/models", timeout=10).json()["data"][0]["id"]
    case = CASES[name]
    got, expected = comparable(answer_of(api, case)), comparable(case["vllm"])
    assert got["status"] == expected["status"], got
    if expected["status"] != 200:  # the same status and field; vLLM's own wording where tandem shares it
        assert got["body"]["error"]["param"] == expected["body"]["error"]["param"]
        if expected["status"] == 404 and expected["body"]["error"]["param"] == "response_id":
            assert got["body"]["error"]["message"] == expected["body"]["error"]["message"]
        return
    assert got == expected


@pytest.mark.parametrize(("responses_case", "chat_case"), [("string input", "chat twin of string input"),
                                                           ("instructions and messages",
                                                            "chat twin of instructions and messages")])
def test_greedy_text_equals_the_chat_completion_of_the_same_messages(api: str, responses_case: str,
                                                                     chat_case: str) -> None:
    vllm_text = CASES[responses_case]["vllm"]["body"]["output"][0]["content"][0]["text"]
    assert CASES[chat_case]["vllm"]["body"]["choices"][0]["message"]["content"] == vllm_text
    chat = httpx2.post(api + "/v1/chat/completions", json=CASES[chat_case]["request"], timeout=300).json()
    answer = httpx2.post(api + "/v1/responses", json=CASES[responses_case]["request"], timeout=300).json()
    assert chat["choices"][0]["message"]["content"] == answer["output"][0]["content"][0]["text"] == vllm_text


def test_the_openai_client_reads_both_forms(api: str) -> None:
    c = openai.OpenAI(base_url=f"{api}/v1", api_key="none", max_retries=0, timeout=300)
    expected = CASES["string input"]["vllm"]["body"]["output"][0]["content"][0]["text"]
    request = CASES["string input"]["request"]
    whole = c.responses.create(input=request["input"], max_output_tokens=request["max_output_tokens"], temperature=0,
                               model=c.models.list().data[0].id)
    assert whole.output_text == expected and whole.status == "completed"
    events = list(c.responses.create(input=request["input"], max_output_tokens=request["max_output_tokens"],
                                     temperature=0, model=whole.model, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == expected  # type: ignore[union-attr]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected  # type: ignore[union-attr]
