"""A real SMG gateway (PyPI `smg`, Rust) in front of two tandem engines serving SmolLM2-135M-Instruct.

`smg launch --worker-urls grpc://A grpc://B --model-path DIR --policy cache_aware`: SMG tokenizes, renders
the chat template and detokenizes in Rust, and drives the engines over `vllm.grpc.engine.VllmEngine`
(engine_svc/api/smg/servicer.py). The official `openai` client talks to SMG, and to a tandem frontend
(its own OpenAI API) on engine A, with the same requests:
- chat and completions, streaming and not: greedy text equal to tandem's own frontend;
- n=2 (two sampled choices), logprobs with top alternatives (equal to tandem's), stop strings (the same
  cut and the same token count: the engine stopped at the match);
- a client that goes away mid-stream: the engine aborts the request (its running count drops to 0 and it
  generates no more than a few tokens past the disconnect).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from tests.engine_stream import engine_load
from tests.realmodel.support import CHAT_QUESTIONS, MAX_TOKENS, Fleet
from tests.support import Service, free_port, wait_until

pytestmark = pytest.mark.slow

SMG = Path(sys.executable).parent / "smg"
COMPLETION_PROMPTS = ("The capital of France is", "def fibonacci(n):")
ENGINE_FLAGS = ("--max-model-len", "2048", "--max-num-seqs", "8")


class Gateway(Service):
    """The smg process; it serves HTTP, so readiness is a model list that names the model."""

    def wait_ready(self, model: str, timeout: float) -> None:
        def ready() -> bool:
            assert self.running(), f"smg exited:\n{self.log()}"
            try:
                models = httpx2.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2).json()
                workers = httpx2.get(f"http://127.0.0.1:{self.port}/workers", timeout=2).json()
            except (httpx2.HTTPError, ValueError):
                return False
            healthy = [w for w in workers.get("workers", []) if w.get("is_healthy")]
            return any(m.get("id") == model for m in models.get("data", [])) and len(healthy) == 2

        wait_until(ready, timeout, "smg ready with both engines", interval=0.5)


class Deployment:
    def __init__(self, engines: list[Service], metrics_ports: list[int], gateway: Gateway, http_port: int,
                 model: str) -> None:
        self.engines, self.metrics_ports, self.model = engines, metrics_ports, model
        self.smg = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="none", max_retries=0,
                                 timeout=300)
        self.tandem = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0,
                                    timeout=300)

    def generated_tokens(self) -> float:
        """Tokens sampled by both engines so far (their tandem_generation_tokens_total)."""
        total = 0.0
        for port in self.metrics_ports:
            for line in httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
                if line.startswith("tandem_generation_tokens_total"):
                    total += float(line.split()[-1])
        return total

    def running(self) -> int:
        return sum(engine_load(e.address).num_running + engine_load(e.address).num_waiting for e in self.engines)


@pytest.fixture(scope="module")
def deployment(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    assert SMG.exists(), "the smg gateway is not installed (the dev extra pins it; run `make install`)"
    logs = tmp_path_factory.mktemp("smg-logs")
    with Fleet(logs) as fleet:
        metrics_ports = [free_port(), free_port()]
        engines = [fleet.engine(smollm2_dir, "--metrics-port", str(metrics), *ENGINE_FLAGS)
                   for metrics in metrics_ports]
        http_port = free_port()
        fleet.frontend(engines[0], "--model", str(smollm2_dir), "--http-port", str(http_port))
        fleet.wait_serving()
        gateway_port = free_port()
        gateway = Gateway("smg", [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(gateway_port),
                                  "--worker-urls", *(f"grpc://{e.address}" for e in engines),
                                  "--model-path", str(smollm2_dir), "--policy", "cache_aware",
                                  "--prometheus-port", str(free_port()), "--log-level", "warn"],
                          gateway_port, logs)
        fleet.start(gateway)
        gateway.wait_ready(smollm2_dir.name, 60)
        yield Deployment(engines, metrics_ports, gateway, http_port, smollm2_dir.name)


def chat(client: openai.OpenAI, model: str, question: str, **params: object) -> openai.types.chat.ChatCompletion:
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, **params}
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                          **params)  # type: ignore[call-overload]


def test_chat_and_completions_give_tandem_s_greedy_text(deployment: Deployment) -> None:
    d = deployment
    for question in CHAT_QUESTIONS:
        ours, theirs = chat(d.tandem, d.model, question), chat(d.smg, d.model, question)
        assert theirs.choices[0].message.content == ours.choices[0].message.content, question
        assert theirs.choices[0].finish_reason == ours.choices[0].finish_reason
        assert theirs.usage.completion_tokens == ours.usage.completion_tokens
        assert theirs.usage.prompt_tokens == ours.usage.prompt_tokens
        streamed = chat(d.smg, d.model, question, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            ours.choices[0].message.content
    for prompt in COMPLETION_PROMPTS:
        params = {"model": d.model, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS}
        ours_c, theirs_c = d.tandem.completions.create(**params), d.smg.completions.create(**params)
        assert theirs_c.choices[0].text == ours_c.choices[0].text, prompt
        streamed_c = d.smg.completions.create(**params, stream=True)
        assert "".join(c.choices[0].text for c in streamed_c if c.choices) == ours_c.choices[0].text


def test_n_samples_and_logprobs(deployment: Deployment) -> None:
    d = deployment
    question = CHAT_QUESTIONS[1]
    sampled = chat(d.smg, d.model, question, n=2, temperature=0.9, seed=5)
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    assert all(c.message.content for c in sampled.choices)
    assert sampled.choices[0].message.content != sampled.choices[1].message.content
    ours, theirs = (chat(client, d.model, question, logprobs=True, top_logprobs=2) for client in (d.tandem, d.smg))
    mine, gate = ours.choices[0].logprobs.content, theirs.choices[0].logprobs.content
    assert [t.token for t in gate] == [t.token for t in mine]
    assert [t.logprob for t in gate] == pytest.approx([t.logprob for t in mine], abs=1e-3)
    for a, b in zip(gate, mine):
        assert [x.token for x in a.top_logprobs] == [x.token for x in b.top_logprobs]


def test_stop_strings_end_the_request_where_tandem_does(deployment: Deployment) -> None:
    d = deployment
    question = CHAT_QUESTIONS[1]
    full = chat(d.tandem, d.model, question).choices[0].message.content
    words = full.split()
    stop = words[len(words) // 2]
    for stream in (False, True):
        ours = chat(d.tandem, d.model, question, stop=[stop])
        if stream:
            chunks = list(chat(d.smg, d.model, question, stop=[stop], stream=True,
                               stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = next(c.usage for c in chunks if c.usage)
        else:
            theirs = chat(d.smg, d.model, question, stop=[stop])
            text, finish, usage = theirs.choices[0].message.content, [theirs.choices[0].finish_reason], theirs.usage
        assert text == ours.choices[0].message.content and stop not in text and len(text) < len(full)
        assert finish == ["stop"]
        assert usage.completion_tokens == ours.usage.completion_tokens  # the engine stopped at the match


def test_a_client_that_goes_away_is_aborted_in_the_engine(deployment: Deployment) -> None:
    d = deployment
    wait_until(lambda: d.running() == 0, 30, "engines idle")
    before = d.generated_tokens()
    stream = d.smg.completions.create(model=d.model, prompt="Count to one thousand: 1, 2, 3,", temperature=0,
                                      max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
    for received, _ in enumerate(stream, 1):
        if received == 5:
            break
    assert d.running() == 1
    stream.close()
    gone = time.monotonic()
    wait_until(lambda: d.running() == 0, 15, "the request aborted after the client left")
    generated = d.generated_tokens() - before
    assert generated < 1500, "the request ran to the end: nothing aborted it"
    print(f"aborted {time.monotonic() - gone:.2f}s after the disconnect; {generated:.0f} tokens generated")
