"""The Llama-family model against Hugging Face transformers (float32 oracle), plus TP sharding math.

Tiny random models are built with transformers' config classes, saved as safetensors and loaded with
tandem's loader. Weights are re-drawn with a larger spread than HF's init so that logits are O(1)
and a wrong position, mask or head mapping shows up far above the tolerance.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine_svc.attention.backend import AttentionMetadata
from engine_svc.attention.torch_backend import TorchAttentionBackend
from engine_svc.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine_svc.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine_svc.model.layers.rotary import RotaryEmbedding, read_rope_config
from engine_svc.model.loader import load_config, load_model
from engine_svc.model.registry import build_model

BLOCK_SIZE = 4
NUM_BLOCKS = 48
ATOL = 1e-4

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attn_implementation="eager",
)

CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2_mqa": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"num_key_value_heads": 1}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
}


def _scramble(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _save_pair(name: str, path):
    """(HF model, tandem model) for one configuration, sharing the weights saved under `path`."""
    config_cls, model_cls, extra = CONFIGS[name]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**COMMON, **extra})).eval()
    _scramble(hf, seed=1)
    hf.save_pretrained(path)
    return hf, load_model(path, torch.float32, "cpu", TorchAttentionBackend())


@pytest.fixture(scope="module")
def saved_pairs(tmp_path_factory):
    """name -> (name, HF model, tandem model, checkpoint dir), built once per module on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (name, *_save_pair(name, path), path)
        return cache[name]

    return get


@pytest.fixture(params=list(CONFIGS))
def hf_pair(request, saved_pairs):
    return saved_pairs(request.param)


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _new_caches(model) -> list[torch.Tensor]:
    # Large finite garbage: attending to a slot that was never written changes the output. (Finite,
    # because the backend's contract is a finite cache: masked positions are weighted by an exact 0.)
    shape = model.attn_backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    gen = torch.Generator().manual_seed(1234)
    return [1e4 * torch.randn(shape, generator=gen) for _ in range(model.num_layers)]


class Seq:
    """A sequence being fed to the model step by step, with its own (shuffled) block table."""

    def __init__(self, tokens: list[int], blocks: list[int]) -> None:
        self.tokens, self.blocks, self.computed = tokens, blocks, 0

    def slot(self, pos: int) -> int:
        return self.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def _step(model, caches, batch: list[tuple[Seq, int]]) -> list[torch.Tensor]:
    """Run one forward over `batch` [(seq, num new tokens)], decodes first; return each request's logits."""
    ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
    for seq, n in batch:
        span = range(seq.computed, seq.computed + n)
        ids += [seq.tokens[p] for p in span]
        positions += list(span)
        slots += [seq.slot(p) for p in span]
        q_lens.append(n)
        seq_lens.append(seq.computed + n)
    width = max(len(seq.blocks) for seq, _ in batch)
    table = [seq.blocks + [0] * (width - len(seq.blocks)) for seq, _ in batch]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
        logits = model.compute_logits(hidden)
    for seq, n in batch:
        seq.computed += n
    return list(logits.split(q_lens))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _blocks(n: int, seed: int) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def test_model_spec_matches_config(hf_pair):
    name, hf, ours, _ = hf_pair
    cfg = hf.config
    assert ours.num_layers == cfg.num_hidden_layers
    assert ours.num_kv_heads == cfg.num_key_value_heads
    assert ours.head_dim == (32 if name == "qwen3" else 16)
    assert ours.vocab_size == 256
    assert ours.is_tied == (name == "llama_tied")


def test_full_prefill_matches_hf(hf_pair):
    _, hf, ours, _ = hf_pair
    tokens = _tokens(21, seed=2)
    seq = Seq(tokens, _blocks(6, seed=3))
    (logits,) = _step(ours, _new_caches(ours), [(seq, len(tokens))])
    expected = _hf_logits(hf, tokens)
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero tensors
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def test_chunked_prefill_then_decodes_match_hf(hf_pair):
    _, hf, ours, _ = hf_pair
    tokens = _tokens(26, seed=4)
    expected = _hf_logits(hf, tokens)
    seq, caches = Seq(tokens, _blocks(7, seed=5)), _new_caches(ours)
    got = [*_step(ours, caches, [(seq, 7)]), *_step(ours, caches, [(seq, 13)])]
    while seq.computed < len(tokens):
        got += _step(ours, caches, [(seq, 1)])
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=1e-4)


def test_mixed_batch_matches_hf(hf_pair):
    _, hf, ours, _ = hf_pair
    caches = _new_caches(ours)
    block_ids = _blocks(15, seed=6)
    a = Seq(_tokens(10, seed=7), block_ids[0:3])
    b = Seq(_tokens(5, seed=8), block_ids[3:5])
    c = Seq(_tokens(30, seed=9), block_ids[5:13])
    _step(ours, caches, [(a, 9), (b, 4)])
    _step(ours, caches, [(c, 11)])
    out_a, out_b, out_c = _step(ours, caches, [(a, 1), (b, 1), (c, 19)])
    torch.testing.assert_close(out_a[0], _hf_logits(hf, a.tokens)[9], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out_b[0], _hf_logits(hf, b.tokens)[4], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out_c, _hf_logits(hf, c.tokens)[11:], atol=ATOL, rtol=1e-4)


def test_llama3_rope_frequencies_match_hf():
    config_cls, _, extra = CONFIGS["llama3_rope"]
    cfg = config_cls(**{**COMMON, **extra})
    theta, params = read_rope_config(cfg)
    assert (theta, params["rope_type"]) == (10000.0, "llama3")
    hf_inv_freq, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg)
    rope = RotaryEmbedding(16, 64, theta, params, torch.float32)
    positions = torch.tensor([0, 5, 63])
    cos, sin = rope.cos_sin(positions)
    freqs = positions[:, None].float() * hf_inv_freq[None, :]
    torch.testing.assert_close(cos[:, 0, :8], freqs.cos())
    torch.testing.assert_close(sin[:, 0, 8:], freqs.sin())
    unscaled = 1.0 / theta ** (torch.arange(0, 16, 2).float() / 16)
    assert not torch.allclose(hf_inv_freq, unscaled)  # the scaling is exercised, not a no-op


def test_rope_config_read_from_both_config_forms():
    new_style = SimpleNamespace(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    old_style = SimpleNamespace(rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0})
    bare = SimpleNamespace(rope_theta=123.0)
    assert read_rope_config(new_style) == (500.0, {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    assert read_rope_config(old_style) == (500.0, {"type": "linear", "rope_type": "linear", "factor": 2.0})
    assert read_rope_config(bare) == (123.0, {"rope_type": "default"})
    with pytest.raises(ValueError, match="yarn"):
        RotaryEmbedding(16, 8, 500.0, {"rope_type": "yarn", "factor": 2.0})


def test_tied_checkpoint_has_no_lm_head_tensor(saved_pairs):
    _, _, ours, path = saved_pairs("llama_tied")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_missing_lm_head_ties_embeddings(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    _scramble(hf, seed=10)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(tmp_path, "float32", "cpu", TorchAttentionBackend())
    assert ours.is_tied


def test_missing_weight_is_named(tmp_path):
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(tmp_path, torch.float32, "cpu", TorchAttentionBackend())


def test_unsupported_architecture_is_named(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        build_model(load_config(tmp_path), torch.float32, "cpu", TorchAttentionBackend())


def test_bfloat16_model_tracks_float32(saved_pairs):
    _, _, ours32, path = saved_pairs("qwen3")
    ours16 = load_model(path, "bfloat16", "cpu", TorchAttentionBackend())
    assert ours16.lm_head.weight.dtype == torch.bfloat16
    tokens = _tokens(12, seed=11)
    (l32,) = _step(ours32, _new_caches(ours32), [(Seq(tokens, _blocks(3, seed=12)), 12)])
    caches16 = [c.to(torch.bfloat16) for c in _new_caches(ours16)]
    (l16,) = _step(ours16, caches16, [(Seq(tokens, _blocks(3, seed=12)), 12)])
    assert l16.dtype == torch.float32
    assert (l16 - l32).abs().mean() < 0.05 * l32.abs().mean()


# ---------------------------------------------------------------- tensor-parallel sharding (by hand)


def _shards(cls, *args, **kwargs):
    """The same layer built as rank 0 and rank 1 of a TP group of 2."""
    return [cls(*args, **kwargs, params_dtype=torch.float32, tp_rank=r, tp_size=2) for r in (0, 1)]


def test_column_parallel_shards_reassemble():
    full_w, full_b = torch.randn(12, 8), torch.randn(12)
    x = torch.randn(3, 8)
    outs = []
    for layer in _shards(ColumnParallelLinear, 8, 12, True):
        layer.weight.weight_loader(layer.weight, full_w)
        layer.bias.weight_loader(layer.bias, full_b)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, dim=-1), x @ full_w.T + full_b)


def test_merged_column_parallel_shards_reassemble():
    gate, up = torch.randn(10, 6), torch.randn(10, 6)
    layers = _shards(MergedColumnParallelLinear, 6, [10, 10])
    for layer in layers:
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
    assert torch.equal(layers[0].weight, torch.cat([gate[:5], up[:5]]))
    assert torch.equal(layers[1].weight, torch.cat([gate[5:], up[5:]]))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_qkv_parallel_shards_reassemble(num_kv_heads):
    head, heads = 3, 4
    q = torch.randn(heads * head, 5)
    k, v = torch.randn(num_kv_heads * head, 5), torch.randn(num_kv_heads * head, 5)
    layers = _shards(QKVParallelLinear, 5, head, heads, num_kv_heads, False)
    for layer in layers:
        for shard, w in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, w, shard)
    kv_per_rank = max(num_kv_heads // 2, 1) * head
    assert all(layer.num_kv_heads * head == kv_per_rank for layer in layers)
    parts = [layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size]) for layer in layers]
    assert torch.equal(torch.cat([p[0] for p in parts]), q)
    if num_kv_heads >= 2:
        assert torch.equal(torch.cat([p[1] for p in parts]), k)
        assert torch.equal(torch.cat([p[2] for p in parts]), v)
    else:  # one KV head, replicated on both ranks
        assert all(torch.equal(p[1], k) and torch.equal(p[2], v) for p in parts)


def test_row_parallel_partial_sums_reassemble():
    full_w, bias = torch.randn(6, 10), torch.randn(6)
    x = torch.randn(4, 10)
    partial = []
    for rank, layer in enumerate(_shards(RowParallelLinear, 10, 6, True)):
        layer.weight.weight_loader(layer.weight, full_w)
        layer.bias.weight_loader(layer.bias, bias)
        partial.append(layer(x[:, rank * 5 : (rank + 1) * 5]))  # no TP group: all-reduce is the identity
    torch.testing.assert_close(partial[0] + partial[1], x @ full_w.T + bias)


def test_vocab_parallel_embedding_and_lm_head_reassemble():
    table = torch.randn(11, 4)  # odd vocab: rank 1 holds one zero padding row
    ids = torch.tensor([0, 5, 6, 10])
    hidden = torch.randn(2, 4)
    embeds, logits = [], []
    for emb, head in zip(_shards(VocabParallelEmbedding, 11, 4), _shards(ParallelLMHead, 11, 4), strict=True):
        emb.weight.weight_loader(emb.weight, table)
        head.weight.weight_loader(head.weight, table)
        embeds.append(emb(ids))
        logits.append(head.compute_logits(hidden))
    torch.testing.assert_close(embeds[0] + embeds[1], table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :11], hidden @ table.T)
    assert torch.equal(logits[1][:, -1], torch.zeros(2))
