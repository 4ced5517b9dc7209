"""The LoRA engine arguments (vLLM's names) and their bounds, checked before any adapter is read.

`--enable-lora --lora-modules name=path [name=path ...] --max-loras N --max-lora-rank R --max-cpu-loras M`:

- `max_loras`: distinct adapters in one step, = adapter slots on the device (vLLM: default 1);
- `max_lora_rank`: the largest adapter rank served (vLLM: default 16; one of vLLM's allowed ranks);
- `max_cpu_loras`: adapters held on the host (at least max_loras). Every adapter of `--lora-modules` is
  read at start and kept, so their count may not exceed it; unset, it is max(max_loras, their count)
  (vLLM's default is max_loras: it reads --lora-modules lazily).

Adapter ids are the 1-based positions in `lora_modules` (0 = the base model), the same in every process.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices for --max-lora-rank
MAX_LORAS_LIMIT = 64  # slots on the device: each one costs every targeted layer rank x (in + out) weights
MAX_CPU_LORAS_LIMIT = 1024
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


class LoRAArgumentError(ValueError):
    """A LoRA argument out of bounds; the message names the argument."""


def parse_lora_modules(specs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """`name=path` strings -> ((name, path), ...), names unique and well formed, paths non-empty."""
    modules: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise LoRAArgumentError(f"--lora-modules {spec!r}: expected name=path")
        modules.append((name, path))
    check_lora_modules(modules)
    return tuple(modules)


def check_lora_modules(modules: Iterable[tuple[str, str]]) -> None:
    seen: set[str] = set()
    for name, path in modules:
        if not _NAME.match(name):
            raise LoRAArgumentError(f"--lora-modules name {name!r}: 1-128 characters of letters, digits and "
                                    "._:/@+- starting with a letter or digit")
        if name in seen:
            raise LoRAArgumentError(f"--lora-modules name {name!r} is given twice")
        if not path:
            raise LoRAArgumentError(f"--lora-modules {name}: empty path")
        seen.add(name)


def check_lora_args(*, enable_lora: bool, lora_modules: tuple[tuple[str, str], ...], max_loras: int,
                    max_lora_rank: int, max_cpu_loras: int | None) -> None:
    """The bounds of the LoRA arguments (EngineConfig calls it at construction)."""
    if not enable_lora:
        if lora_modules:
            raise LoRAArgumentError("--lora-modules needs --enable-lora")
        return
    if not 1 <= max_loras <= MAX_LORAS_LIMIT:
        raise LoRAArgumentError(f"--max-loras {max_loras} must be in [1, {MAX_LORAS_LIMIT}]")
    if max_lora_rank not in MAX_LORA_RANKS:
        raise LoRAArgumentError(f"--max-lora-rank {max_lora_rank} must be one of "
                                f"{', '.join(map(str, MAX_LORA_RANKS))}")
    cpu = resolved_max_cpu_loras(max_loras, max_cpu_loras, len(lora_modules))
    if not max_loras <= cpu <= MAX_CPU_LORAS_LIMIT:
        raise LoRAArgumentError(f"--max-cpu-loras {cpu} must be in [--max-loras ({max_loras}), "
                                f"{MAX_CPU_LORAS_LIMIT}]")
    check_lora_modules(lora_modules)
    if len(lora_modules) > cpu:
        raise LoRAArgumentError(f"--lora-modules names {len(lora_modules)} adapters, more than --max-cpu-loras "
                                f"({cpu}) holds: raise --max-cpu-loras")


def resolved_max_cpu_loras(max_loras: int, max_cpu_loras: int | None, num_modules: int = 0) -> int:
    return max(max_loras, num_modules) if max_cpu_loras is None else max_cpu_loras


def lora_ids(lora_modules: tuple[tuple[str, str], ...]) -> dict[str, int]:
    """Adapter name -> id (1-based position; 0 is the base model)."""
    return {name: i + 1 for i, (name, _) in enumerate(lora_modules)}
