"""A Node.js client (`@grpc/grpc-js` + `@grpc/proto-loader`, tests/e2e/node/generate.js) against a real
frontend: its greedy completions equal the Python client's, and an invalid request comes back as
INVALID_ARGUMENT whose `grpc-status-details-bin` (google.rpc.Status + BadRequest) Node decodes to the
same field paths. Runs on the session's `cluster`.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from frontend_svc.client import collect
from tests.support import ROOT, DeadlineClient

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("node") / "generate.js"
MAX_TOKENS = 16


def run_node(address: str, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: install Node.js 18+ and run `make install`")
    for package in ("@grpc/grpc-js", "@grpc/proto-loader", "protobufjs"):
        if not (ROOT / "node_modules" / package / "package.json").is_file():
            pytest.fail(f"node_modules/{package} is missing: run `make install` (npm install) first")
    done = subprocess.run([node, str(SCRIPT), address, json.dumps(requests)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"node failed ({done.returncode}):\n{done.stderr}"
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def test_node_client_streams_what_the_python_client_gets(cluster: Any) -> None:
    cluster.heal()
    frontend = cluster.frontends[0]
    vocab = cluster.model_info(frontend).vocab_size
    rng = random.Random(11)
    token_prompt = [rng.randrange(3, vocab) for _ in range(12)]
    text_prompt = "The capital of France is"
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    node = run_node(frontend.address, [
        {"token_ids": token_prompt, "sampling_params": greedy},
        {"text": text_prompt, "sampling_params": greedy},
    ])
    with DeadlineClient(frontend.address) as client:
        python = [collect(client.generate(token_ids=token_prompt, **greedy))[0],
                  collect(client.generate(text_prompt, **greedy))[0]]
    for got, want in zip(node, python):
        assert got["ok"], got
        assert got["token_ids"] == want["token_ids"] and len(want["token_ids"]) == MAX_TOKENS
        assert got["text"] == want["text"]
        assert got["finish_reason"] == "FINISH_REASON_LENGTH"
        assert got["num_responses"] > 1  # streamed, not one piece
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
        assert got["usage"]["prompt_tokens"] == want["usage"].prompt_tokens


def test_node_client_decodes_bad_request_details(cluster: Any) -> None:
    [bad] = run_node(cluster.frontends[0].address, [
        {"token_ids": [1, 100_000], "sampling_params": {"top_p": 0, "max_tokens": 4}},
    ])
    assert not bad["ok"]
    assert bad["code_name"] == "INVALID_ARGUMENT" and bad["code"] == 3
    assert sorted(bad["field_violations"]) == ["sampling_params.top_p", "token_ids.ids"]
