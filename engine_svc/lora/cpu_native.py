"""The native CPU op of multi-LoRA (csrc/cpu_lora.cpp), built once like engine_svc/attention/cpu_paged.py's.

`lora_add_(x, out, a, b, offsets, sorted, counts, starts)` adds every adapter token's delta to `out` in
place in one call per LoRA layer: a pass over each slot's A rows for the tokens routed to it (float32 dot
products), then a pass over its B rows, summed in float32 and rounded once into out (kernels/lora_ref.py's
numerics). The token -> slot mapping is kernels/lora_mapping.py's (tokens grouped by slot, each token once).
It serves steps of at most `NATIVE_MAX_TOKENS` tokens (decode, short prefills); longer steps keep the torch
layouts of slots.py, whose GEMMs win once each slot holds many tokens. `TANDEM_CPU_LORA=0` switches the op
off (the torch paths run: A/B, and where no compiler is found).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from engine_svc.attention import cpu_paged

NATIVE_ENV = "TANDEM_CPU_LORA"
NATIVE_MAX_TOKENS = 128  # tokens per step up to which the native op runs (its dot products beat small GEMMs)
_CSRC = Path(__file__).with_name("csrc")
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def native() -> ModuleType | None:
    """The built native LoRA op, or None (switched off, or no compiler: the torch paths run)."""
    if os.environ.get(NATIVE_ENV, "1") == "0" or not cpu_paged.enabled():
        return None
    return cpu_paged.build("tandem_cpu_lora", _CSRC, ("cpu_lora.cpp",), (cpu_paged.MATH_HEADER,),
                           "LoRA deltas")


def native_for(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The op when it serves this device and dtype (CPU, float32 or bfloat16) and is built, else None."""
    if device.type != "cpu" or dtype not in _DTYPES:
        return None
    return native()


if __name__ == "__main__":  # `python -m engine_svc.lora.cpu_native`: build (or find) the cached op
    import logging
    import sys

    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if native() is not None else 1)
