"""A hybrid model (tiny gpt-oss: sliding and full layers in turn, window 8) through the split: a real
engine process with its KV groups (blocks of 4, a 64-block pool, chunks of 16) behind a real frontend;
prompts longer than the window, twice over a shared prefix (the second wave hits it); greedy tokens
over gRPC equal transformers' with logprobs within 1e-4 (float32), and every block is back after."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_greedy_stream_equals_hf, engine_service, frontend_service
from tests.engine.test_hf_exact import make_prompts
from tests.engine_stream import engine_idle, engine_load
from tests.support import DeadlineClient, free_port, wait_until

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


def test_gpt_oss_with_kv_groups_behind_a_frontend_equals_transformers(make_model, tmp_path) -> None:
    model = make_model("gpt_oss")
    engine = engine_service(model, free_port(), tmp_path, "--block-size", "4", "--num-gpu-blocks-override", "64",
                            "--max-num-batched-tokens", "16").start().wait_serving()
    frontend = frontend_service(model, engine.port, free_port(), tmp_path).start().wait_serving()
    shared = make_prompts(31, 1, 500, lo=24, hi=24)[0]
    try:
        with DeadlineClient(frontend.address) as client:
            for tail in make_prompts(32, 3, 500, lo=3, hi=9):
                assert_greedy_stream_equals_hf(client, model, shared + tail, MAX_TOKENS)
        wait_until(lambda: engine_idle(engine.address), 10, "every KV block back in the pool")
        load = engine_load(engine.address)
        assert load.num_total_blocks == 64
        assert load.prefix_cache_hits >= 2 * 24  # the second and third prompts hit the shared 24 tokens
    finally:
        frontend.stop()
        engine.stop()
