"""Which attention layers of a model slide, and over how many tokens (torch-free).

`layer_windows(arch, config, num_layers)` reads a config.json (a dict, or a transformers config object)
the way transformers builds each architecture's attention, and gives layer i's sliding window W (a query
at position p sees keys p - W < k <= p), None for a full-attention layer:
- Mistral, Mixtral: every layer slides over `sliding_window` when it is set.
- Qwen2, Qwen3: only with `use_sliding_window`; then the layers named "sliding_attention" in
  `layer_types`, or without `layer_types` the layers from `max_window_layers` on.
- Qwen3-MoE: every layer, with `use_sliding_window`.
- gpt-oss: `layer_types` (sliding and full layers in turn), engine_svc/model/moe_config.py.
- Llama: none.

`kv_window(windows)` is the window the KV cache may free blocks behind: defined only when every layer
slides with the same window (one block table per request for all layers: a block can go back to the
pool only when no layer will read it again). Hybrid models (gpt-oss, Qwen2/Qwen3 mixing full and
sliding layers, layers over different windows) get KV groups of one attention type each, each with its
own table, instead: engine_svc/kv/groups.py.
"""

from __future__ import annotations

from typing import Any

from engine_svc.model.moe_config import LAYER_TYPES, MoeConfigError
from engine_svc.model.moe_config import layer_windows as gpt_oss_windows

_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM")
_USE_FLAG_EVERY_LAYER = ("Qwen3MoeForCausalLM",)
_USE_FLAG_BY_LAYER_TYPE = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def _window(config: Any) -> int | None:
    window = _field(config, "sliding_window")
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise MoeConfigError(f"config field sliding_window={window!r} must be a positive integer")
    return window


def layer_windows(arch: str, config: Any, num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (None: full attention), or None when no layer slides. ValueError
    (MoeConfigError) naming the field when `sliding_window` or `layer_types` is malformed."""
    if arch == "GptOssForCausalLM":
        windows: tuple[int | None, ...] = gpt_oss_windows(config, num_layers)
    elif arch in _EVERY_LAYER or (arch in _USE_FLAG_EVERY_LAYER and _field(config, "use_sliding_window")):
        windows = (_window(config),) * num_layers
    elif arch in _USE_FLAG_BY_LAYER_TYPE and _field(config, "use_sliding_window"):
        window = _window(config)
        types = _field(config, "layer_types")
        if types is None:
            first = int(_field(config, "max_window_layers") or 0)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        if not isinstance(types, (list, tuple)) or len(types) != num_layers or any(t not in LAYER_TYPES
                                                                                   for t in types):
            raise MoeConfigError(f"config field layer_types={types!r} must list one of {', '.join(LAYER_TYPES)} "
                                 f"for each of the {num_layers} layers")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:
        return None
    return windows if any(w is not None for w in windows) else None


def kv_window(windows: tuple[int | None, ...] | None) -> int | None:
    """The window every layer shares, or None (some layer attends to everything, or windows differ)."""
    if not windows or windows[0] is None or any(w != windows[0] for w in windows):
        return None
    return windows[0]
