"""Structured outputs and tool calling with SmolLM2-135M-Instruct, through both public APIs of a real
engine + frontend pair (`--tool-call-parser hermes`): JSON schemas at temperature 0.7 always validate,
regex and choice outputs match fully, tool choices yield valid calls, streaming tool calls reassemble to
the non-streaming ones, bad constraints are 400 / INVALID_ARGUMENT, and a schema that compiles slowly
does not stall another client's stream. A 135M model almost never writes valid JSON on its own; with
the engine's grammar every completion must."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx2
import jsonschema
import openai
import pytest
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from tests.realmodel.support import Fleet
from tests.support import MAX_STALL_S, Service, free_port, max_gap, wait_until

pytestmark = pytest.mark.slow

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_bounds_and_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3},
        "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["colors", "size"], "additionalProperties": False},
    "integer_range_and_optional": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number"},
        "nickname": {"type": "string", "maxLength": 12}},
        "required": ["age"], "additionalProperties": False},
    "pattern_list": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                     "minItems": 1, "maxItems": 4},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
# Compiles for seconds (~3.5 s alone here: xgrammar expands the nested bounded repetitions), 55 bytes.
SLOW_SCHEMA = {"type": "string", "pattern": "^([a-z]{1,40}-){1,60}$"}


class Served:
    def __init__(self, engine: Service, frontend: Service, http_port: int, model: str) -> None:
        self.engine, self.frontend, self.http_port, self.model = engine, frontend, http_port, model
        self.url = f"http://127.0.0.1:{http_port}/v1"
        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)
        self.channel = grpc.insecure_channel(frontend.address)
        self.api = pb_grpc.GenerationServiceStub(self.channel)


@pytest.fixture(scope="module")
def served(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    http_port = free_port()
    with Fleet(tmp_path_factory.mktemp("structured-logs")) as fleet:
        engine = fleet.engine(smollm2_dir, "--max-model-len", "1024", "--max-num-seqs", "16")
        frontend = fleet.frontend(engine, "--model", str(smollm2_dir), "--http-port", str(http_port),
                                  "--tool-call-parser", "hermes")
        fleet.wait_serving()
        wait_until(lambda: httpx2.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200, 30,
                   "/health 200")
        served = Served(engine, frontend, http_port, smollm2_dir.name)
        yield served
        served.channel.close()


def ask(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with a JSON example for '{name}'."}]


def test_every_completion_validates_against_its_schema(served: Served) -> None:
    def run(name: str) -> tuple[str, list[Any]]:
        schema = SCHEMAS[name]
        response = served.client.chat.completions.create(
            model=served.model, messages=ask(name), temperature=0.7, n=3, max_completion_tokens=160, seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                    "strict": True}})
        return name, list(response.choices)

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(run, SCHEMAS))
    for name, choices in results:
        for choice in choices:
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_regex_and_choice(served: Served) -> None:
    c = served.client.chat.completions
    obj = c.create(model=served.model, messages=ask("a book"), temperature=0.7, max_completion_tokens=120,
                   response_format={"type": "json_object"}, seed=1)
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"
    regex = c.create(model=served.model, messages=ASK, temperature=0.7, n=4, max_completion_tokens=30,
                     extra_body={"structured_outputs": {"regex": pattern}})
    for choice in regex.choices:
        assert re.fullmatch(pattern, choice.message.content), choice.message.content
    choices = ["sunny", "rainy", "cloudy with a chance of meatballs"]
    picked = served.client.completions.create(model=served.model, prompt="The weather today is", n=4,
                                              temperature=0.7, max_tokens=30,
                                              extra_body={"structured_outputs": {"choice": choices}})
    assert {c.text for c in picked.choices} <= set(choices)


def test_the_grpc_api_takes_the_same_constraints(served: Served) -> None:
    schema = SCHEMAS["array_bounds_and_enum"]
    request = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Colors as JSON please.")],
                     add_generation_prompt=True),
        sampling_params=pb.SamplingParams(temperature=0.7, max_tokens=100, n=2,
                                          structured_outputs=pb.StructuredOutputs(json=json.dumps(schema))))
    texts: dict[int, str] = {}
    for response in served.api.Generate(request, timeout=120):
        texts[response.index] = texts.get(response.index, "") + response.text
    assert len(texts) == 2
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)
    choice = pb.GenerateRequest(text="Yes or no?", sampling_params=pb.SamplingParams(
        max_tokens=10, structured_outputs=pb.StructuredOutputs(choice=pb.Choices(choices=["yes", "no"]))))
    assert "".join(r.text for r in served.api.Generate(choice, timeout=60)) in ("yes", "no")


def test_bad_constraints_are_400_and_invalid_argument(served: Served) -> None:
    c = served.client.chat.completions
    for body in ({"structured_outputs": {"regex": "(unclosed"}},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
                 {"structured_outputs": {"grammar": "root ::= nowhere"}}):
        with pytest.raises(openai.BadRequestError) as info:
            c.create(model=served.model, messages=ASK, max_completion_tokens=5, extra_body=body)
        assert "structured_outputs" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:  # two constraints at once
        c.create(model=served.model, messages=ASK, max_completion_tokens=5, response_format={"type": "json_object"},
                 extra_body={"structured_outputs": {"regex": "a"}})
    assert "structured_outputs" in str(info.value)
    big = {"type": "object", "description": "x" * 300_000}  # over the 256 KiB bound: refused before any work
    with pytest.raises(openai.BadRequestError) as info:
        c.create(model=served.model, messages=ASK, max_completion_tokens=5,
                 response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": big}})
    assert "structured_outputs.json" in str(info.value)
    huge = httpx2.post(f"{served.url}/chat/completions", timeout=30, json={
        "messages": ASK, "structured_outputs": {"json": {"description": "x" * 10_000_000}}})
    assert huge.status_code == 413  # a 10 MB schema never reaches the parser
    bad = pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(
        max_tokens=4, structured_outputs=pb.StructuredOutputs(regex="(ab")))
    with pytest.raises(grpc.RpcError) as rpc:
        list(served.api.Generate(bad, timeout=60))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.structured_outputs" in (rpc.value.details() or "")


def test_named_and_required_tool_choices_yield_valid_calls(served: Served) -> None:
    c = served.client.chat.completions
    named = c.create(model=served.model, messages=ASK, tools=[WEATHER, TIME], temperature=0.7, n=3,
                     max_completion_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in named.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # parallel_tool_calls=False: exactly one call (the schema's maxItems 1; unbounded, this model at 0.7
    # may keep adding calls until max tokens)
    required = c.create(model=served.model, messages=ASK, tools=[WEATHER, TIME], temperature=0.7, n=3,
                        max_completion_tokens=120, tool_choice="required", parallel_tool_calls=False)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def streamed_calls(served: Served, **kwargs: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in served.client.chat.completions.create(model=served.model, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def whole_calls(served: Served, **kwargs: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    choice = served.client.chat.completions.create(model=served.model, **kwargs).choices[0]
    return (choice.message.content, [(t.function.name, t.function.arguments) for t in choice.message.tool_calls],
            choice.finish_reason)


def test_streamed_tool_calls_reassemble_to_the_non_streaming_calls(served: Served) -> None:
    required = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0,
                "max_completion_tokens": 120}
    whole = whole_calls(served, **required)
    assert whole[1] and whole[2] == "tool_calls"
    assert streamed_calls(served, **required) == whole
    # tool_choice "auto": the model's own Hermes format, parsed by the frontend. The grammar makes this
    # 135M model write it (text first, then a call), so the test sees the parser, not the model's luck.
    hermes = ('root ::= "Let me check. <tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
              '{\\"city\\": \\"" [A-Z] [a-z]{2,8} "\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>"')
    auto = {"messages": ASK, "tools": [WEATHER, TIME], "temperature": 0.7, "seed": 3, "max_completion_tokens": 80,
            "extra_body": {"structured_outputs": {"grammar": hermes}}}
    content, calls, finish = whole_calls(served, **auto)
    assert content == "Let me check. " and finish == "tool_calls"
    ((name, arguments),) = calls
    assert name == "get_weather" and re.fullmatch(r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}', arguments)
    assert streamed_calls(served, **auto) == (content, calls, finish)


def test_a_victim_stream_keeps_flowing_while_a_slow_schema_compiles(served: Served) -> None:
    arrivals: list[float] = []
    victim = served.api.Generate(pb.GenerateRequest(text="Tell me a long story.", sampling_params=pb.SamplingParams(
        temperature=0, max_tokens=900, ignore_eos=True)), timeout=300)

    def read_victim() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled once the attacker has its answer
            for _ in victim:
                arrivals.append(time.monotonic())

    reader = threading.Thread(target=read_victim)
    reader.start()
    wait_until(lambda: len(arrivals) >= 5, 60, "the victim's first tokens")
    start = time.monotonic()
    try:
        slow = served.client.chat.completions.create(
            model=served.model, messages=ASK, max_completion_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}})
        seconds = time.monotonic() - start
        wait_until(lambda: arrivals[-1] > start + seconds, 10, "a victim token after the attacker's answer")
    finally:
        victim.cancel()
        reader.join(30)
    assert slow.choices[0].message.content.startswith('"')  # it compiled and ran: a JSON string
    assert seconds > 2 * MAX_STALL_S, f"the schema compiled too fast to test ({seconds:.2f} s)"
    gap = max_gap(arrivals, start, start + seconds)
    assert gap < MAX_STALL_S, f"the victim stalled {gap:.2f} s while the schema compiled ({seconds:.2f} s)"


def test_the_unconstrained_row_of_a_mixed_batch_equals_its_run_alone(served: Served) -> None:
    """A greedy request without a constraint, batched with constrained ones (their streams overlap), yields
    the tokens it yields alone: the bitmask touches the constrained rows only."""
    plain = pb.GenerateRequest(text="The history of Rome", sampling_params=pb.SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))
    regex = pb.GenerateRequest(text="A number:", sampling_params=pb.SamplingParams(
        temperature=0.7, max_tokens=40, n=2, structured_outputs=pb.StructuredOutputs(regex="[0-9]{10,30}")))
    list(served.api.Generate(regex, timeout=120))  # the grammar is compiled and cached: no wait below

    def run(request: pb.GenerateRequest) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        times: list[float] = []
        for response in served.api.Generate(request, timeout=120):
            tokens += response.token_ids
            times.append(time.monotonic())
        return tokens, times

    alone, _ = run(plain)
    with ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(run, regex)
        time.sleep(0.05)
        (mixed, plain_times), (_, constrained_times) = pool.submit(run, plain).result(), constrained.result()
    assert plain_times[0] < constrained_times[-1] and constrained_times[0] < plain_times[-1], "no shared batch"
    assert mixed == alone
