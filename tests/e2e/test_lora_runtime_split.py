"""LoRA adapters loaded and unloaded at run time through the split (engine + frontend processes), with
VLLM_ALLOW_RUNTIME_LORA_UPDATING set on the frontend: load -> use (PEFT's tokens and logprobs) -> unload
-> 404; every refusal with vLLM's status and message, changing nothing; a victim stream keeps flowing
while adapters load and unload (its longest gap printed and bounded); a request in flight on an adapter
being unloaded ends exactly; vLLM gRPC's LoadLora / UnloadLora; an engine that joins later learns the
loaded adapters before it is routed to, and a load one engine refuses is taken back on the others; the
Responses and Messages APIs select an adapter by `model` and answer what chat completions answer; while the
engine's workers' read of a loaded adapter is held (the reader's test gate), a victim stream keeps flowing
and the new adapter's request waits, then answers PEFT's tokens; a read that fails (files changed after the
check) ends its waiting request with an error and the frontend's lists drop the name."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc
from tandem.vendor.vllm import control_pb2 as cpb
from tandem.vendor.vllm import control_pb2_grpc as cpb_grpc

from engine_svc.lora.reader import GATE_ENV
from tests.e2e.conftest import engine_service, free_port, frontend_service, serving_over_http, wait_until
from tests.engine.lora_support import ALL_MODULES, make_adapter, make_prompts, peft_greedy
from tests.support import rpc_error

pytestmark = pytest.mark.slow
MAX_TOKENS = 6
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "3")
MAX_GAP_S = 3.0  # the victim's longest pause between tokens (a shared 2-core machine: generous)


class Stack:
    def __init__(self, url: str, model: Path, dirs: dict[str, Path], frontend_address: str, engine_address: str,
                 engine_port_2: int, logs: Path, gate: Path) -> None:
        self.url, self.model, self.dirs, self.gate = url, model, dirs, gate
        self.frontend_address, self.engine_address = frontend_address, engine_address
        self.engine_port_2, self.logs = engine_port_2, logs

    def load(self, name: str, path: Path | str, **extra) -> httpx2.Response:
        return httpx2.post(f"{self.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path),
                                                                     **extra}, timeout=60)

    def unload(self, name: str) -> httpx2.Response:
        return httpx2.post(f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)

    def models(self) -> list[str]:
        return [c["id"] for c in httpx2.get(f"{self.url}/v1/models", timeout=10).json()["data"]]


@pytest.fixture(scope="module")
def stack(make_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = make_model("llama")
    root = tmp_path_factory.mktemp("runtime-split-adapters")
    dirs = {"sql": make_adapter(model, root / "sql", rank=8, alpha=16, targets=ALL_MODULES, seed=51),
            "dyn": make_adapter(model, root / "dyn", rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                                seed=52, rslora=True),
            "alt": make_adapter(model, root / "alt", rank=2, alpha=4, targets=("o_proj", "up_proj"), seed=53),
            "r16": make_adapter(model, root / "r16", rank=16, alpha=8, targets=("k_proj",), seed=54)}
    logs = tmp_path_factory.mktemp("lora-runtime-logs")
    engine = engine_service(model, free_port(), logs, *LORA_FLAGS, "--lora-modules", f"sql={dirs['sql']}")
    engine_port_2 = free_port()  # a second engine the frontend knows of, started by a test
    http_port = free_port()
    frontend = frontend_service(model, [engine.port, engine_port_2], free_port(), logs, "--http-port", str(http_port))
    gate = root / "read-gate"  # the engine workers' reads start only while it exists (a test removes it)
    gate.touch()
    with pytest.MonkeyPatch.context() as env:  # the processes' environment (each copies it at start)
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        env.setenv(GATE_ENV, str(gate))
        with serving_over_http(engine, frontend, http_port) as url:
            yield Stack(url, model, dirs, frontend.address, engine.address, engine_port_2, logs, gate)


def _complete(url: str, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> httpx2.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    return httpx2.post(f"{url}/v1/completions", json=body, timeout=60)


def _assert_peft(stack: Stack, adapter: Path | None, prompt: list[int], response: httpx2.Response) -> None:
    assert response.status_code == 200, response.text
    tokens, logprobs = peft_greedy(stack.model, adapter, prompt, MAX_TOKENS)
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == tokens
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)


def _error(response: httpx2.Response, status: int, kind: str, *needles: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind, error
    for needle in needles:
        assert needle in error["message"], error


def test_load_use_unload_then_404(stack: Stack) -> None:
    response = stack.load("dyn", stack.dirs["dyn"])
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'dyn' added successfully."
    assert stack.models()[1:] == ["sql", "dyn"]
    card = httpx2.get(f"{stack.url}/v1/models/dyn", timeout=10).json()
    assert card["parent"] == stack.model.name
    prompt = make_prompts(61, 1, 500)[0]
    _assert_peft(stack, stack.dirs["dyn"], prompt, _complete(stack.url, "dyn", prompt))
    _assert_peft(stack, stack.dirs["sql"], prompt, _complete(stack.url, "sql", prompt))
    response = stack.unload("dyn")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'dyn' removed successfully."
    assert "dyn" not in stack.models()
    gone = _complete(stack.url, "dyn", prompt)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    _error(stack.unload("dyn"), 404, "NotFoundError", "The lora adapter 'dyn' cannot be found.")


def test_every_refusal_has_vllms_status_and_changes_nothing(stack: Stack, tmp_path: Path) -> None:
    before = stack.models()
    _error(stack.load("sql", stack.dirs["dyn"]), 400, "InvalidUserInput", "'sql' has already been loaded",
           "load_inplace")
    _error(stack.load(stack.model.name, stack.dirs["dyn"]), 400, "InvalidUserInput", "conflicts with a served base")
    _error(stack.load("", stack.dirs["dyn"]), 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path'")
    missing = tmp_path / "nothing-here"
    _error(stack.load("ghost", missing), 404, "NotFoundError", f"Loading lora ghost failed: No adapter found for {missing}")
    _error(stack.load("rel", "relative/dir"), 400, "InvalidUserInput", "lora_path", "absolute")
    bad = tmp_path / "rank32"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 32, "lora_alpha": 8}))
    _error(stack.load("big", bad), 400, "InvalidUserInput", "r 32 is above --max-lora-rank 16")
    assert stack.load("a1", stack.dirs["alt"]).status_code == 200
    assert stack.load("a2", stack.dirs["alt"]).status_code == 200
    _error(stack.load("a3", stack.dirs["alt"]), 400, "BadRequestError", "--max-cpu-loras (3)")
    for name in ("a1", "a2"):
        assert stack.unload(name).status_code == 200
    _error(stack.unload("never"), 404, "NotFoundError", "'never' cannot be found")
    assert stack.models() == before


def test_victim_stream_flows_while_adapters_load_and_unload_and_an_unloaded_ones_request_ends_exactly(
        stack: Stack) -> None:
    """A stream on `sql` (the victim) and one on `alt` (unloaded mid-stream) run while `dyn` loads and
    unloads twice: both equal PEFT's tokens, and the victim's longest gap stays bounded."""
    assert stack.load("alt", stack.dirs["alt"]).status_code == 200
    long_tokens = 48
    prompts = make_prompts(62, 2, 500, lo=10, hi=10)
    results: dict[str, tuple[list[int], float]] = {}

    def stream(name: str, prompt: list[int]) -> None:
        body = {"model": name, "prompt": prompt, "max_tokens": long_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        tokens: list[int] = []
        gap, last = 0.0, None
        with httpx2.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if last is not None:
                    gap = max(gap, now - last)
                last = now
                tokens.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
        results[name] = (tokens, gap)

    threads = [threading.Thread(target=stream, args=("sql", prompts[0])),
               threading.Thread(target=stream, args=("alt", prompts[1]))]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    assert stack.unload("alt").status_code == 200  # its request is in flight
    for _ in range(2):
        assert stack.load("dyn", stack.dirs["dyn"]).status_code == 200
        assert stack.unload("dyn").status_code == 200
    for thread in threads:
        thread.join(120)
    print(f"victim stream: longest gap between tokens {results['sql'][1] * 1000:.0f} ms while adapters loaded")
    assert results["sql"][0] == peft_greedy(stack.model, stack.dirs["sql"], prompts[0], long_tokens)[0]
    assert results["alt"][0] == peft_greedy(stack.model, stack.dirs["alt"], prompts[1], long_tokens)[0]
    assert results["sql"][1] < MAX_GAP_S
    assert _complete(stack.url, "alt", prompts[1]).status_code == 404


def test_victim_stream_flows_while_the_workers_read_is_held_and_the_new_adapters_request_waits(
        stack: Stack) -> None:
    """The gate closed: `held` loads (200 at once) and a request on it waits while the victim on `sql` gets
    token after token; the gate open: that request answers PEFT's tokens."""
    victim_prompt, prompt = make_prompts(63, 2, 500, lo=10, hi=10)
    victim_max = 64
    victim_tokens: list[int] = []
    answers: dict[str, httpx2.Response] = {}

    def victim() -> None:
        body = {"model": "sql", "prompt": victim_prompt, "max_tokens": victim_max, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        with httpx2.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    victim_tokens.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])

    stack.gate.unlink()
    try:
        streaming = threading.Thread(target=victim)
        streaming.start()
        wait_until(lambda: len(victim_tokens) >= 3, timeout=60)
        assert stack.load("held", stack.dirs["dyn"]).status_code == 200
        waiting = threading.Thread(target=lambda: answers.update(held=_complete(stack.url, "held", prompt)))
        waiting.start()
        seen = len(victim_tokens)
        wait_until(lambda: len(victim_tokens) >= seen + 12 or not streaming.is_alive(), timeout=30)
        assert len(victim_tokens) >= seen + 12, "the victim stalled while the read was held"
        assert waiting.is_alive() and "held" not in answers
    finally:
        stack.gate.touch()
    waiting.join(60)
    streaming.join(120)
    _assert_peft(stack, stack.dirs["dyn"], prompt, answers["held"])
    assert victim_tokens == peft_greedy(stack.model, stack.dirs["sql"], victim_prompt, victim_max)[0]
    assert stack.unload("held").status_code == 200


def test_a_read_that_fails_after_the_check_ends_its_request_with_an_error_and_every_list_drops_it(
        stack: Stack, tmp_path: Path) -> None:
    """The weights change between the engine's check and its workers' read: the request waiting on the
    adapter ends with an error naming it, and the engine's WatchLoraAdapters tells the frontend, whose
    /v1/models drops it."""
    import shutil

    copy = tmp_path / "broken"
    shutil.copytree(stack.dirs["dyn"], copy)
    answers: dict[str, httpx2.Response] = {}
    stack.gate.unlink()
    try:
        assert stack.load("broken", copy).status_code == 200
        wait_until(lambda: "broken" in stack.models(), timeout=10)
        waiting = threading.Thread(target=lambda: answers.update(broken=_complete(stack.url, "broken", [5, 6, 7])))
        waiting.start()
        (copy / "adapter_model.safetensors").write_bytes(b"changed after the check")
        wait_until(lambda: _num_waiting(stack.engine_address) == 1, timeout=30, what="the request waits")
    finally:
        stack.gate.touch()
    waiting.join(60)
    assert answers["broken"].status_code == 400, answers["broken"].text
    assert "could not read LoRA adapter 'broken'" in answers["broken"].json()["error"]["message"]
    wait_until(lambda: "broken" not in stack.models(), timeout=10, what="the frontend hears of the failed read")


def _num_waiting(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return epb_grpc.EngineCoreServiceStub(channel).GetLoad(epb.GetLoadRequest(), timeout=10).num_waiting


def test_responses_and_messages_select_the_adapter_as_chat_does(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Tell me about tandem bicycles"}]
    common = {"temperature": 0, "max_tokens": MAX_TOKENS}

    def chat(model: str) -> str:
        response = httpx2.post(f"{stack.url}/v1/chat/completions", json={"model": model, "messages": messages,
                                                                         **common}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        return str(response.json()["choices"][0]["message"]["content"])

    responses = httpx2.post(f"{stack.url}/v1/responses", json={
        "model": "sql", "input": messages[0]["content"], "temperature": 0, "max_output_tokens": MAX_TOKENS},
        timeout=60)
    assert responses.status_code == 200, responses.text
    anthropic = httpx2.post(f"{stack.url}/v1/messages", json={"model": "sql", "messages": messages, **common},
                            timeout=60)
    assert anthropic.status_code == 200, anthropic.text
    text = chat("sql")
    assert text != chat(stack.model.name)  # the adapter moves the answer, so equality below means something
    assert responses.json()["model"] == "sql" and responses.json()["output"][0]["content"][0]["text"] == text
    assert anthropic.json()["model"] == "sql" and anthropic.json()["content"][0]["text"] == text
    for route, body in (("/v1/responses", {"model": "nope", "input": "hi"}),
                        ("/v1/messages", {"model": "nope", "messages": messages, "max_tokens": 2})):
        response = httpx2.post(f"{stack.url}{route}", json=body, timeout=10)
        assert response.status_code == 404 and "nope" in response.text, route


def test_vllm_grpc_load_and_unload_lora(stack: Stack) -> None:
    with grpc.insecure_channel(stack.frontend_address) as channel:
        control = cpb_grpc.ControlStub(channel)
        loaded = control.LoadLora(cpb.LoadLoraRequest(lora_name="g", source_path=str(stack.dirs["alt"])), timeout=60)
        assert (loaded.adapter.lora_name, loaded.adapter.source_path) == ("g", str(stack.dirs["alt"]))
        listed = [(a.lora_name, a.lora_id) for a in control.ListLoras(cpb.ListLorasRequest(), timeout=10).adapters]
        assert listed[0] == ("sql", 1) and ("g", loaded.adapter.lora_id) in listed
        again = rpc_error(lambda: control.LoadLora(cpb.LoadLoraRequest(lora_name="g", source_path="/x"), timeout=10))
        assert again.code() == grpc.StatusCode.ALREADY_EXISTS and "'g' has already been loaded" in again.details()
        assert control.UnloadLora(cpb.UnloadLoraRequest(lora_name="g"), timeout=60).adapter.lora_name == "g"
        gone = rpc_error(lambda: control.UnloadLora(cpb.UnloadLoraRequest(lora_name="g"), timeout=10))
        assert gone.code() == grpc.StatusCode.NOT_FOUND


def test_an_engine_that_joins_learns_loaded_adapters_and_a_refused_load_is_taken_back(stack: Stack) -> None:
    """The second engine serves rank <= 8 only: it learns `dyn` (rank 4) when it joins, and refuses `r16`,
    which the first engine then unloads again."""
    assert stack.load("dyn", stack.dirs["dyn"]).status_code == 200
    flags = [f if f != "16" else "8" for f in LORA_FLAGS]
    second = engine_service(stack.model, stack.engine_port_2, stack.logs, *flags).start()
    try:
        second.wait_serving()

        def adapters(address: str) -> list[str]:
            with grpc.insecure_channel(address) as channel:
                info = epb_grpc.EngineCoreServiceStub(channel).GetEngineInfo(epb.GetEngineInfoRequest(), timeout=10)
            return list(info.lora_adapters)

        wait_until(lambda: adapters(second.address) == ["dyn"], 60, "the joining engine learns dyn")
        wait_until(lambda: httpx2.get(f"{stack.url}/v1/models", timeout=5).status_code == 200, 10, "models")
        _error(stack.load("r16", stack.dirs["r16"]), 400, "InvalidUserInput", "r 16 is above --max-lora-rank 8")
        assert "r16" not in adapters(stack.engine_address) and "r16" not in stack.models()
        prompt = make_prompts(63, 1, 500)[0]
        for _ in range(4):  # whichever engine each lands on
            _assert_peft(stack, stack.dirs["dyn"], prompt, _complete(stack.url, "dyn", prompt))
    finally:
        second.stop()
        stack.unload("dyn")
