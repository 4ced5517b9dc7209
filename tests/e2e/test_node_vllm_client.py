"""A Node.js client of vLLM's native gRPC API (`@grpc/grpc-js` loading the vendored vllm protos as they are,
tests/e2e/node/vllm_generate.js) against a real frontend and engine: its greedy streams equal the text and
token ids of tandem's own API for the same request; n > 1 streams each index; logprobs, ranks and candidates
come as parallel arrays; a stop string and a structured output (choice) are honoured; Control.Abort ends a
stream with ABORTED; Control describes the server; bad input is INVALID_ARGUMENT naming vLLM's field paths.
Runs on the session's `cluster`.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from frontend_svc.client import collect
from tests.support import ROOT, DeadlineClient

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("node") / "vllm_generate.js"
MAX_TOKENS = 12


def run_node(address: str, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: install Node.js 18+ and run `make install`")
    for package in ("@grpc/grpc-js", "@grpc/proto-loader", "protobufjs"):
        if not (ROOT / "node_modules" / package / "package.json").is_file():
            pytest.fail(f"node_modules/{package} is missing: run `make install` (npm install) first")
    done = subprocess.run([node, str(SCRIPT), address, json.dumps(ops)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"node failed ({done.returncode}):\n{done.stderr}"
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def test_node_streams_what_tandem_s_own_api_answers(cluster: Any) -> None:
    cluster.heal()
    frontend = cluster.frontends[0]
    vocab = cluster.model_info(frontend).vocab_size
    token_prompt = [random.Random(5).randrange(3, vocab) for _ in range(10)]
    text_prompt = "The capital of France is"
    greedy = {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}
    response = {"output_token_ids": True, "prompt_token_ids": True}
    by_ids, by_text, unary = run_node(frontend.address, [
        {"op": "stream", "request": {"token_ids": token_prompt, "stopping": greedy, "response": response}},
        {"op": "stream", "request": {"text": text_prompt, "stopping": greedy, "response": response}},
        {"op": "unary", "request": {"text": text_prompt, "stopping": greedy, "response": response}},
    ])
    with DeadlineClient(frontend.address) as client:  # vLLM's unset temperature is greedy: tandem's 0
        want = [collect(client.generate(token_ids=token_prompt, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))[0],
                collect(client.generate(text_prompt, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]]
    for got, expected in zip((by_ids, by_text), want):
        assert got["ok"], got
        seq = got["sequences"]["0"]
        assert seq["token_ids"] == expected["token_ids"] and len(seq["token_ids"]) == MAX_TOKENS
        assert seq["text"] == expected["text"]
        assert seq["finish_reason"] == "LENGTH" and seq["num_output_tokens"] == MAX_TOKENS
        assert seq["num_responses"] > 1  # streamed, not one piece
        assert got["prompt_tokens"] == expected["usage"].prompt_tokens
    assert unary["ok"] and unary["sequences"]["0"]["text"] == want[1]["text"]
    assert unary["sequences"]["0"]["token_ids"] == want[1]["token_ids"]


def test_node_gets_sequences_logprobs_stops_and_structured_output(cluster: Any) -> None:
    frontend = cluster.frontends[0]
    prompt = "Once upon a time"
    several, ranked, stopped, chosen = run_node(frontend.address, [
        {"op": "stream", "request": {"text": prompt, "temperature": 1.0,
                                     "sampling": {"num_sequences": 3, "seed": 7},
                                     "stopping": {"max_new_tokens": 5, "ignore_eos": True}}},
        {"op": "stream", "request": {"text": prompt, "stopping": {"max_new_tokens": 4, "ignore_eos": True},
                                     "response": {"output_logprobs": True, "output_token_ids": True,
                                                  "output_candidates": {"top_n": 3}}}},
        {"op": "stream", "request": {"text": prompt, "stopping": {"max_new_tokens": 16, "ignore_eos": True},
                                     "response": {"output_token_ids": True}}},
        {"op": "stream", "request": {"text": prompt, "stopping": {"max_new_tokens": 8},
                                     "decoding": {"choice": {"choices": ["yes", "no"]}}}},
    ])
    assert several["ok"] and sorted(several["sequences"]) == ["0", "1", "2"]
    assert all(s["num_output_tokens"] == 5 and s["finish_reason"] == "LENGTH" for s in several["sequences"].values())
    seq = ranked["sequences"]["0"]
    assert len(seq["token_ids"]) == len(seq["logprobs"]) == len(seq["ranks"]) == len(seq["candidates"]) == 4
    assert all(len(c) == 3 for c in seq["candidates"]) and all(lp <= 0 for lp in seq["logprobs"])
    text = stopped["sequences"]["0"]["text"]
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), text
    [cut] = run_node(frontend.address, [
        {"op": "stream", "request": {"text": prompt, "stopping": {"max_new_tokens": 16, "ignore_eos": True,
                                                                   "stop_strings": [stop]}}}])
    cut_seq = cut["sequences"]["0"]
    assert cut_seq["text"] == text[:text.index(stop)] and cut_seq["finish_reason"] == "STOP"
    assert cut_seq["stop_reason"] == {"stop_string": stop}
    assert chosen["ok"] and chosen["sequences"]["0"]["text"] in ("yes", "no"), chosen


def test_node_aborts_through_control_and_reads_server_info(cluster: Any) -> None:
    frontend = cluster.frontends[0]
    rid = f"node-abort-{uuid.uuid4().hex[:8]}"
    aborted, info = run_node(frontend.address, [
        {"op": "abort", "request": {"request_id": rid, "text": "Count:", "stopping": {"max_new_tokens": 2000,
                                                                                       "ignore_eos": True}}},
        {"op": "server_info"},
    ])
    assert aborted["ok"] and aborted["aborted"] and "abort_error" not in aborted, aborted
    seq = aborted["sequences"]["0"]
    assert seq["finish_reason"] == "ABORTED" and seq["num_output_tokens"] < 2000
    assert info["ok"] and info["server"]["max_model_len"] == cluster.model_info(frontend).max_model_len
    assert info["model"]


def test_node_decodes_bad_request_field_paths(cluster: Any) -> None:
    [bad] = run_node(cluster.frontends[0].address, [
        {"op": "stream", "request": {"token_ids": [1, 100_000_000], "sampling": {"top_p": 1.5},
                                     "kv": {"cache_salt": "s"}}},
    ])
    assert not bad["ok"] and bad["code_name"] == "INVALID_ARGUMENT"
    assert {"sampling.top_p", "kv.cache_salt"} <= set(bad["field_violations"]), bad
