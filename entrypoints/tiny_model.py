"""Build tiny random-weight Hugging Face model directories for tests, demos and benchmarks.

Nothing can be downloaded where tandem is developed, so every model it serves in tests comes from here:
a byte-level BPE tokenizer trained on the bundled ``data/corpus.txt`` plus a transformers causal LM
(Llama, Mistral, Qwen2, Qwen3, or the mixture-of-experts Qwen3-MoE, Mixtral and gpt-oss) with seeded
random weights, saved as a standard HF dir.

Invariants:
  * The same arguments (seed included) produce byte-identical files.
  * The model's ``vocab_size`` equals the tokenizer's real size (``len(tokenizer)``), so every id the
    model can emit decodes.
  * Special tokens have fixed ids: ``<|bos|>``=0, ``<|eos|>``=1, ``<|pad|>``=2, ``<|im_start|>``=3,
    ``<|im_end|>``=4. ``generation_config.json`` lists both ``<|eos|>`` and ``<|im_end|>`` as EOS.
  * Any byte sequence is encodable (ByteLevel pre-tokenizer over the full 256-byte alphabet).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, IM_START, IM_END)  # ids 0..4, in this order
ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
GPT_OSS_WINDOW = 8  # gpt-oss's sliding layers see 8 tokens: short prompts already outgrow the window

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, preceded by the BOS token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Pre-tokenizer split: contractions, letter runs (with one leading non-letter), single digits,
# punctuation runs, newlines, other whitespace. It is the pattern transformers' Qwen2Tokenizer rebuilds
# its pipeline with (it ignores tokenizer.json's pre-tokenizer), so AutoTokenizer agrees with
# tokenizer.json for every arch.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # byte alphabet + specials: the smallest usable vocab


def init_std(hidden_size: int) -> float:
    """Weight init std: 0.3 at hidden 64, 0.15 at hidden 256 (HF's default is 0.02).

    Scaled so the final logits have a std of ~2.5 at any width: large enough that greedy decoding is
    varied and top-2 near-ties are rare, small enough that sampling still has real entropy (~4 nats).
    """
    return 2.4 / math.sqrt(hidden_size)


def train_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on the bundled corpus (deterministic).

    The result may hold fewer than ``vocab_size`` tokens when the corpus runs out of merges.
    Encoding with special tokens prepends ``<|bos|>``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {_MIN_VOCAB} (256 bytes + specials), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS_PATH)], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise AssertionError(f"special token {token} did not get id {expected_id}")
    return tokenizer


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_tokenizer(tokenizer: Any, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": None,  # byte-level: nothing is unknown (and Qwen2Tokenizer would add one)
            "additional_special_tokens": [IM_START, IM_END],
            "added_tokens_decoder": added,
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out_dir / "special_tokens_map.json",
        {
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )


def _build_config(arch: str, num_experts: int = 4, num_experts_per_tok: int = 2, **sizes: Any) -> Any:
    """The transformers config for ``arch``; ``sizes`` are the common LlamaConfig-style kwargs. MoE archs
    get ``num_experts`` experts of ``intermediate_size`` each, ``num_experts_per_tok`` per token."""
    import transformers

    common = dict(
        sizes,
        rms_norm_eps=1e-6,
        initializer_range=init_std(sizes["hidden_size"]),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":  # q/k/v projections always carry a bias in Qwen2
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, use_sliding_window=False)
    moe = dict(num_experts_per_tok=num_experts_per_tok, output_router_logits=False)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **moe, num_experts=num_experts, norm_topk_prob=True,
                                           moe_intermediate_size=sizes["intermediate_size"], use_sliding_window=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, **moe, num_local_experts=num_experts, sliding_window=None)
    if arch == "gpt_oss":  # sliding / full attention layers in turn, YaRN rotary as the real models
        layers = sizes["num_hidden_layers"]
        return transformers.GptOssConfig(
            **common, **moe, num_local_experts=num_experts, sliding_window=GPT_OSS_WINDOW,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _perturb_defaults(model: Any, std: float) -> None:
    """Randomise parameters HF initialises to constants (biases = 0, norm weights = 1).

    Otherwise an engine that dropped a bias or a norm weight would still match the reference.
    Uses the global torch RNG, so it follows ``torch.manual_seed``.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # also gpt-oss's experts' gate_up_proj_bias / down_proj_bias
                param.normal_(0.0, std)
            elif "norm" in name and name.endswith(".weight"):
                param.add_(torch.randn_like(param) * std)


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
) -> Path:
    """Write a random-weight HF causal-LM dir (weights, config, tokenizer) to ``out_dir``; return it.

    ``head_dim`` defaults to ``hidden_size // num_heads``; ``intermediate_size`` to ``2 * hidden_size``.
    ``vocab_size`` is a target: the model's vocab is the trained tokenizer's real size (<= target).
    ``num_experts`` / ``num_experts_per_tok`` apply to the MoE archs (each expert of ``intermediate_size``).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
        head_dim = hidden_size // num_heads

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    _save_tokenizer(tokenizer, out, max_position_embeddings)

    config = _build_config(
        arch,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_defaults(model, init_std(hidden_size))
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[1, 4], pad_token_id=2)
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_arg_parser() -> argparse.ArgumentParser:
    """Arguments of ``tandem make-tiny-model``."""
    p = argparse.ArgumentParser(prog="tandem make-tiny-model", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="directory to write the model into (created if missing)")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--num-experts", type=int, default=4, help="MoE archs: experts per layer")
    p.add_argument("--num-experts-per-tok", type=int, default=2, help="MoE archs: experts each token uses")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry: build the model dir and print its path."""
    args = build_arg_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = make_tiny_model(
        args.out_dir,
        arch=args.arch,
        seed=args.seed,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings,
        num_experts=args.num_experts,
        num_experts_per_tok=args.num_experts_per_tok,
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
