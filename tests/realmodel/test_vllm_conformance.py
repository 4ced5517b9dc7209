"""tandem's OpenAI API against vLLM's recorded answers, request for request.

tests/realmodel/data/vllm_conformance.json holds OpenAI requests (greedy, SmolLM2-135M-Instruct in
float32, max_model_len 2048) and what vLLM answered (status; for a success each choice's text and finish
reason, and the usage), recorded by scripts/record_vllm_conformance.py against a vLLM server (its
docstring has the command). The session's tandem engine + frontend pair (conftest.py `smollm2_pair`, shared
with the Responses and Messages replays) on the converted model directory (the directory vLLM served)
answers every request here; the answers must be the same: texts, finish and stop
reasons, token ids and logprob tokens exactly, logprob values within `LOGPROB_TOL` (two float32 CPU
implementations of the same model), and a system_fingerprint sent where vLLM sends one.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.realmodel.support import SharedPair

pytestmark = pytest.mark.slow

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_conformance.json").read_text())
LOGPROB_TOL = 2e-3
_spec = importlib.util.spec_from_file_location(
    "record_vllm_conformance", Path(__file__).resolve().parents[2] / "scripts" / "record_vllm_conformance.py")
assert _spec is not None and _spec.loader is not None
RECORDER = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(RECORDER)


@pytest.fixture(scope="module")
def api(smollm2_pair: SharedPair) -> str:
    """The session's SmolLM2 pair served as vLLM served it when the answers were recorded (conftest.py)."""
    return smollm2_pair.url


def summary(response: httpx2.Response) -> dict[str, Any]:
    """The recorder's summary of an answer (scripts/record_vllm_conformance.py)."""
    if response.status_code != 200:
        return {"status": response.status_code}
    return dict(RECORDER.summary(200, response.json()))


def assert_same(got: Any, expected: Any, path: str = "") -> None:
    """Equal, floats within LOGPROB_TOL (logprobs); dict keys and list lengths exactly."""
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        assert math.isclose(got, expected, abs_tol=LOGPROB_TOL), f"{path}: {got} != {expected}"
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        for key in expected:
            assert_same(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), f"{path}: {got} != {expected}"
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


@pytest.mark.parametrize("case", RECORDED["cases"], ids=[c["name"] for c in RECORDED["cases"]])
def test_the_same_answer_as_vllm(api: str, case: dict[str, Any]) -> None:
    got = summary(httpx2.post(api + case["route"], json=case["request"], timeout=300))
    expected = dict(case["vllm"])
    if "request_id" not in case["request"]:  # ids are random unless the request names one
        expected.pop("id", None)
        got.pop("id", None)
    assert_same(got, expected)
