"""vLLM's run-time LoRA routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING ("1" / "true", any case):
without it POST /v1/load_lora_adapter and /v1/unload_lora_adapter are 404 (no route), as in vLLM; with it
they answer, and their own checks come first (fake engine, real sockets)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
import pytest

from frontend_svc.engines.lora_admin import runtime_updates_allowed
from tests.openai_api.conftest import HttpStack
from tests.support import LoopThread


@pytest.mark.parametrize(("value", "allowed"), [(None, False), ("0", False), ("false", False), ("yes", False),
                                                ("1", True), (" True ", True)])
def test_the_flag_is_read_as_vllm_reads_it(value: str | None, allowed: bool) -> None:
    env = {} if value is None else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}
    assert runtime_updates_allowed(env) is allowed


@pytest.mark.parametrize("flag", [None, "true"])
def test_routes_exist_only_with_the_flag(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch, flag: str | None) -> None:
    if flag is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", flag)
    stack = HttpStack(loop, tokenizer, tiny_model_dir)
    try:
        stack.wait_http_ready()
        load = httpx2.post(f"{stack.url}/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "/a"}, timeout=10)
        unload = httpx2.post(f"{stack.url}/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=10)
        if flag is None:
            assert load.status_code == unload.status_code == 404
        else:
            assert load.status_code == 400 and "Both 'lora_name' and 'lora_path'" in load.json()["error"]["message"]
            assert unload.status_code == 404 and unload.json()["error"]["message"] == \
                "The lora adapter 'x' cannot be found."
    finally:
        stack.close()
