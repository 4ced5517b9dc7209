"""scripts/demo.py (`make demo`): the engine dtype it asks for.

The demo's model is float32; `--dtype auto` runs it in bfloat16 on CPUs with bfloat16 dot-product
instructions, where SmolLM2's first answer token to the demo's first question is a near-tie that bfloat16
breaks the wrong way ("L'Étoile, ..." instead of "The capital of France is Paris."). The demo asks for
float32 by default, on every CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine_svc import config
from engine_svc.config import EngineConfig

_spec = importlib.util.spec_from_file_location("demo", Path(__file__).resolve().parents[1] / "scripts" / "demo.py")
assert _spec is not None and _spec.loader is not None
DEMO = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(DEMO)


def test_the_demo_runs_float32_where_auto_would_pick_bfloat16(tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "cpu_bf16_is_faster", lambda: True)  # an AVX512-BF16 / AMX CPU
    assert EngineConfig.create(model=str(tiny_model_dir), device="cpu").torch_dtype_name == "bfloat16"
    args = DEMO.parse_args([])
    assert EngineConfig.create(model=str(tiny_model_dir), dtype=args.dtype, device="cpu").torch_dtype_name == "float32"


def test_the_demo_still_takes_another_dtype() -> None:
    assert DEMO.parse_args(["--dtype", "auto"]).dtype == "auto"
