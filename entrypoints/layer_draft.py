"""A draft model cut from a target: its first N decoder layers, with its embedding, final norm and head.

`make_layer_draft(target_dir, out_dir, num_layers)` writes an HF directory (config.json with
`num_hidden_layers = num_layers`, the tensors of those layers, the tokenizer files) that tandem loads as
`{"method": "draft_model", "model": out_dir, ...}`: it shares the target's vocabulary by construction.
`scale_attention` multiplies the layers' attention output projections (the tests use it to make a draft
deliberately different from its target). Used by bench/spec_decode.py and the tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def make_layer_draft(target_dir: str | Path, out_dir: str | Path, num_layers: int,
                     scale_attention: float | None = None) -> Path:
    """Write the draft (see the module docstring) into `out_dir`; return it."""
    from safetensors.torch import load_file, save_file

    src, out = Path(target_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= int(config["num_hidden_layers"]):
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    out.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the layers kept
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",) \
                and not path.name.endswith(".index.json"):
            shutil.copy(path, out / path.name)
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            if name.startswith("model.layers."):
                if int(name.split(".")[2]) >= num_layers:
                    continue
                if scale_attention is not None and ".o_proj." in name:
                    tensor = tensor * scale_attention
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
