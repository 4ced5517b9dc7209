"""MoE models through the split: a real engine process (two gloo ranks, experts placed whole with
--enable-expert-parallel; and Mixtral at one rank) behind a real frontend process; greedy tokens over
gRPC equal transformers', and their logprobs are transformers' log_softmax within 1e-4 (float32)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_greedy_stream_equals_hf, engine_service, frontend_service
from tests.engine.test_hf_exact import make_prompts
from tests.support import DeadlineClient, free_port

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


@pytest.mark.parametrize(("arch", "flags"), [
    ("qwen3_moe", ("--tensor-parallel-size", "2", "--enable-expert-parallel")),
    ("mixtral", ()),
])
def test_moe_engine_behind_a_frontend_equals_transformers(make_model, tmp_path, arch: str, flags) -> None:
    model = make_model(arch)
    engine = engine_service(model, free_port(), tmp_path, *flags).start().wait_serving()
    frontend = frontend_service(model, engine.port, free_port(), tmp_path).start().wait_serving()
    try:
        with DeadlineClient(frontend.address) as client:
            for prompt in make_prompts(12, 3, 500):
                assert_greedy_stream_equals_hf(client, model, prompt, MAX_TOKENS)
    finally:
        frontend.stop()
        engine.stop()
