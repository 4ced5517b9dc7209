"""Mixture-of-experts models against Hugging Face transformers, layer by layer and whole.

- The routing of each architecture (softmax then top-k, renormalised or not; top-k then softmax) equals
  transformers' router modules.
- Whole models (Qwen3-MoE with and without `norm_topk_prob`, with dense layers from `decoder_sparse_step`
  and `mlp_only_layers`; Mixtral; gpt-oss with sliding-window layers, sinks and YaRN) equal transformers' logits in float32 through prefill, chunked prefill
  with decodes and a mixed batch (the paged-attention harness of test_model.py), weights re-drawn so that
  routing is spread over the experts.
- The experts' CPU paths (the native op, torch ops on plain and on oneDNN-packed weights) equal the torch
  reference, including choices routed to -1 (experts held by another rank) and an empty batch, and run
  only the chosen experts; TP shards and EP placements of one layer add up to the whole layer.
- Config fields tandem cannot honour are refused at start with the field named; training-only ones are
  accepted; a checkpoint missing one expert's tensor is named.
- bfloat16 through the engine agrees with transformers within the top-5 (tests/gpu's rule).
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine_svc.attention.torch_backend import TorchAttentionBackend
from engine_svc.config import ConfigError, EngineConfig
from engine_svc.model.layers import moe_cpu
from engine_svc.model.layers.moe import FusedMoE, SparseMoeBlock, route
from engine_svc.model.layers.moe_cpu import CpuExperts
from engine_svc.model.llama import LlamaMLP
from engine_svc.model.loader import load_model
from engine_svc.model.moe_config import MoeSpec
from entrypoints import LLM, SamplingParams
from kernels.fused_moe_ref import fused_experts as reference_experts
from tests.engine.test_model import (
    ATOL,
    COMMON,
    Seq,
    _blocks,
    _hf_logits,
    _new_caches,
    _scramble,
    _step,
    _tokens,
)

QWEN3_MOE = dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
CONFIGS = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, QWEN3_MOE),
    # layers 0 and 2 dense (decoder_sparse_step 2), 3 dense (mlp_only_layers): only layer 1 has experts
    "qwen3_moe_mixed_layers": (transformers.Qwen3MoeConfig, {
        **QWEN3_MOE, "norm_topk_prob": False, "num_hidden_layers": 4, "decoder_sparse_step": 2,
        "mlp_only_layers": [3]}),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                                 sliding_window=None)),
    # windows of 6 on layers 0 and 2 (prompts of 21-30 tokens outgrow them), sinks, YaRN, expert biases
    "gpt_oss": (transformers.GptOssConfig, dict(
        num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
        sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})),
}
SPARSE_LAYERS = {"qwen3_moe": [True, True], "qwen3_moe_mixed_layers": [False, True, False, False],
                 "mixtral": [True, True], "gpt_oss": [True, True, True]}


@pytest.fixture(scope="module")
def moe_pairs(tmp_path_factory):
    """name -> (HF model, tandem model, checkpoint dir), built once per module on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            config_cls, extra = CONFIGS[name]
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**COMMON, **extra})).eval()
            _scramble(hf, seed=1)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            cache[name] = (hf, load_model(path, torch.float32, "cpu", TorchAttentionBackend()), path)
        return cache[name]

    return get


@pytest.fixture(params=list(CONFIGS))
def moe_pair(request, moe_pairs):
    return (request.param, *moe_pairs(request.param))


# ---------------------------------------------------------------------------------------------- routing


def _spec(scoring: str, renormalize: bool, num_experts: int = 8, top_k: int = 2) -> MoeSpec:
    return MoeSpec(num_experts=num_experts, top_k=top_k, intermediate_size=8, scoring=scoring,
                   renormalize=renormalize, sparse_layers=(True,), dense_intermediate_size=8, activation="silu")


@pytest.mark.parametrize("router", ["qwen3_norm", "qwen3_plain", "mixtral", "gpt_oss"])
def test_routing_equals_transformers(router: str) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hidden = 16
    common = dict(hidden_size=hidden, num_experts_per_tok=3)
    hf, spec = {
        "qwen3_norm": (Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(**common, num_experts=8, norm_topk_prob=True)),
                       _spec("softmax_topk", True, top_k=3)),
        "qwen3_plain": (Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(**common, num_experts=8)),
                        _spec("softmax_topk", False, top_k=3)),
        "mixtral": (MixtralTopKRouter(transformers.MixtralConfig(**common, num_local_experts=8)),
                    _spec("softmax_topk", True, top_k=3)),
        "gpt_oss": (GptOssTopKRouter(transformers.GptOssConfig(**common, num_local_experts=8)),
                    _spec("topk_softmax", False, top_k=3)),
    }[router]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))  # logits of O(1): routing spread out
        x = torch.randn(11, hidden, generator=gen)
        _, want_weights, want_ids = hf(x)
        logits = torch.nn.functional.linear(x, hf.weight, getattr(hf, "bias", None))
    weights, ids = route(logits, spec)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-6)
    if spec.renormalize or spec.scoring == "topk_softmax":
        torch.testing.assert_close(weights.sum(-1), torch.ones(11))
    else:
        assert (weights.sum(-1) < 1 - 1e-3).all()  # plain top-k of a softmax: not renormalised


# ------------------------------------------------------------------------------------ whole models vs HF


def test_layers_are_sparse_where_the_config_says(moe_pair) -> None:
    name, _, ours, _ = moe_pair
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert kinds == SPARSE_LAYERS[name]
    assert all(isinstance(layer.mlp, (SparseMoeBlock, LlamaMLP)) for layer in ours.model.layers)
    windows = [layer.self_attn.attn.sliding_window for layer in ours.model.layers]
    assert windows == ([6, None, 6] if name == "gpt_oss" else [None] * len(windows))
    assert all((layer.self_attn.sinks is not None) == (name == "gpt_oss") for layer in ours.model.layers)


def test_prefill_matches_hf(moe_pair) -> None:
    _, hf, ours, _ = moe_pair
    tokens = _tokens(21, seed=2)
    (logits,) = _step(ours, _new_caches(ours), [(Seq(tokens, _blocks(6, seed=3)), len(tokens))])
    expected = _hf_logits(hf, tokens)
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def test_chunked_prefill_then_decodes_match_hf(moe_pair) -> None:
    _, hf, ours, _ = moe_pair
    tokens = _tokens(26, seed=4)
    seq, caches = Seq(tokens, _blocks(7, seed=5)), _new_caches(ours)
    got = [*_step(ours, caches, [(seq, 7)]), *_step(ours, caches, [(seq, 13)])]
    while seq.computed < len(tokens):
        got += _step(ours, caches, [(seq, 1)])
    torch.testing.assert_close(torch.cat(got), _hf_logits(hf, tokens), atol=ATOL, rtol=1e-4)


def test_mixed_batch_matches_hf(moe_pair) -> None:
    _, hf, ours, _ = moe_pair
    caches = _new_caches(ours)
    block_ids = _blocks(15, seed=6)
    a = Seq(_tokens(10, seed=7), block_ids[0:3])
    c = Seq(_tokens(30, seed=9), block_ids[5:13])
    _step(ours, caches, [(a, 9)])
    out_a, out_c = _step(ours, caches, [(a, 1), (c, 19)])
    torch.testing.assert_close(out_a[0], _hf_logits(hf, a.tokens)[9], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out_c, _hf_logits(hf, c.tokens)[:19], atol=ATOL, rtol=1e-4)


def test_missing_expert_tensor_is_named(moe_pairs, tmp_path: Path) -> None:
    _, _, path = moe_pairs("mixtral")
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight"):
        load_model(tmp_path, torch.float32, "cpu", TorchAttentionBackend())


# --------------------------------------------------------------------------------------------- experts


def _random_experts(num_experts: int, hidden: int, size: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * size, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, size, generator=gen) / size**0.5).to(dtype)
    return w13, w2, gen


def _routing(gen: torch.Generator, tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, num_experts, generator=gen)
    return route(logits, _spec("softmax_topk", True, num_experts, top_k))


CPU_PATHS = ("native", "torch", "packed")


def _cpu_experts(path: str, w13: torch.Tensor, w2: torch.Tensor, monkeypatch) -> CpuExperts:
    """CpuExperts forced onto one path: the native op (skipped where it cannot be built), torch ops on the
    stacked weights, or torch ops on oneDNN-packed weights."""
    if path == "native":
        if moe_cpu.native() is None:
            pytest.skip("the native MoE op is not built here")
        calls = []
        real = moe_cpu.native()

        class Spy:
            def moe_experts(self, *args):  # type: ignore[no-untyped-def]
                calls.append(1)
                return real.moe_experts(*args)

        monkeypatch.setattr(moe_cpu, "native", lambda: Spy())
        monkeypatch.setattr(CpuExperts, "calls", calls, raising=False)
    else:
        monkeypatch.setattr(moe_cpu, "native", lambda: None)
    return CpuExperts.from_stacked(w13, w2, pack=path == "packed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", CPU_PATHS)
def test_cpu_experts_equal_the_reference(dtype: torch.dtype, path: str, monkeypatch) -> None:
    w13, w2, gen = _random_experts(8, 64, 24, dtype, seed=1)
    weights, ids = _routing(gen, 13, 8, 3)
    ids[2, 1] = -1  # a choice another rank holds: contributes nothing
    ids[7] = -1
    x = torch.randn(13, 64, generator=gen).to(dtype)
    experts = _cpu_experts(path, w13, w2, monkeypatch)
    got = experts(x, weights, ids)
    want = reference_experts(x, w13, w2, weights, ids)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[7], torch.zeros(64, dtype=dtype))
    assert experts(x[:0], weights[:0], ids[:0]).shape == (0, 64)
    if path == "native":
        assert len(CpuExperts.calls) == 2  # type: ignore[attr-defined]
    if path != "packed":  # one expert taking every token of a 40-token step (several row blocks)
        ids40 = torch.stack([torch.full((40,), 5), torch.randint(0, 5, (40,), generator=gen)], dim=1)
        weights40 = torch.rand(40, 2, generator=gen)
        x40 = torch.randn(40, 64, generator=gen).to(dtype)
        torch.testing.assert_close(experts(x40, weights40, ids40), reference_experts(x40, w13, w2, weights40, ids40),
                                   **tol)


def test_long_prefills_take_the_torch_path(monkeypatch) -> None:
    """A step of more than NATIVE_MAX_TOKENS tokens runs per-expert GEMMs, with the same result."""
    w13, w2, gen = _random_experts(4, 32, 16, torch.float32, seed=5)
    weights, ids = _routing(gen, 70, 4, 2)
    x = torch.randn(70, 32, generator=gen)
    experts = _cpu_experts("native", w13, w2, monkeypatch)
    torch.testing.assert_close(experts(x, weights, ids), reference_experts(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)
    assert len(CpuExperts.calls) == 0  # type: ignore[attr-defined]
    torch.testing.assert_close(experts(x[:3], weights[:3], ids[:3]),
                               reference_experts(x[:3], w13, w2, weights[:3], ids[:3]), atol=1e-5, rtol=1e-5)
    assert len(CpuExperts.calls) == 1  # type: ignore[attr-defined]


def test_cpu_experts_run_only_the_chosen_experts(monkeypatch) -> None:
    w13, w2, _ = _random_experts(16, 32, 8, torch.float32, seed=2)
    experts = _cpu_experts("torch", w13, w2, monkeypatch)
    used: list[int] = []
    real = experts._linear

    def counting(x, weight, bias):  # type: ignore[no-untyped-def]
        stacked = experts.w13 if weight.shape[0] == 16 else experts.w2
        used.append(next(i for i, w in enumerate(stacked) if w.data_ptr() == weight.data_ptr()))
        return real(x, weight, bias)

    monkeypatch.setattr(experts, "_linear", counting)
    ids = torch.tensor([[3, 11], [11, 3], [3, 5]])
    experts(torch.randn(3, 32), torch.full((3, 2), 0.5), ids)
    assert sorted(set(used)) == [3, 5, 11] and len(used) == 6  # gate/up and down, once per chosen expert


@pytest.mark.parametrize("path", CPU_PATHS)
def test_swiglu_with_biases_equals_the_reference(path: str, monkeypatch) -> None:
    w13, w2, gen = _random_experts(4, 32, 16, torch.float32, seed=3)
    b13, b2 = torch.randn(4, 32, generator=gen), torch.randn(4, 32, generator=gen)
    weights, ids = _routing(gen, 9, 4, 2)
    x = 3 * torch.randn(9, 32, generator=gen)  # large enough that the clamps bite
    kwargs = dict(activation="swigluoai", w13_bias=b13, w2_bias=b2, swiglu_alpha=1.702, swiglu_limit=1.0)
    torch.testing.assert_close(_cpu_experts(path, w13, w2, monkeypatch)(x, weights, ids, **kwargs),
                               reference_experts(x, w13, w2, weights, ids, **kwargs), atol=1e-5, rtol=1e-5)


def _per_expert_layer(spec: MoeSpec, rank: int, size: int, ep: bool, w13: torch.Tensor, w2: torch.Tensor) -> FusedMoE:
    layer = FusedMoE(spec, w13.shape[2], torch.float32, expert_parallel=ep, tp_rank=rank, tp_size=size)
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        layer.w13_weight.weight_loader(layer.w13_weight, w13[e, :inter], ("gate", e))
        layer.w13_weight.weight_loader(layer.w13_weight, w13[e, inter:], ("up", e))
        layer.w2_weight.weight_loader(layer.w2_weight, w2[e], ("down", e))
    return layer


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp_shards_and_ep_placements_add_up_to_the_layer(expert_parallel: bool) -> None:
    """Each rank's partial output (before the all-reduce) sums to the whole layer's; under EP each rank
    holds half the experts whole, under TP half of every expert's intermediate dim."""
    spec = MoeSpec(num_experts=8, top_k=2, intermediate_size=16, scoring="softmax_topk", renormalize=True,
                   sparse_layers=(True,), dense_intermediate_size=16, activation="silu")
    w13, w2, gen = _random_experts(8, 32, 16, torch.float32, seed=4)
    weights, ids = _routing(gen, 10, 8, 2)
    x = torch.randn(10, 32, generator=gen)
    ranks = [_per_expert_layer(spec, r, 2, expert_parallel, w13, w2) for r in range(2)]
    if expert_parallel:
        assert ranks[1].w13_weight.shape == (4, 32, 32)
        assert torch.equal(ranks[1].w13_weight, w13[4:]) and torch.equal(ranks[1].w2_weight, w2[4:])
    else:
        assert ranks[1].w13_weight.shape == (8, 16, 32)
        assert torch.equal(ranks[1].w13_weight, torch.cat([w13[:, 8:16], w13[:, 24:]], dim=1))
        assert torch.equal(ranks[1].w2_weight, w2[:, :, 8:])
    partial = [layer(x, weights, ids) for layer in ranks]
    assert not torch.allclose(partial[0], partial[1])
    torch.testing.assert_close(partial[0] + partial[1], reference_experts(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- config at start


def _with_config(model_dir: Path, tmp_path: Path, **changes) -> Path:
    out = tmp_path / "changed"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("arch", "changes", "named"), [
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ("qwen3_moe", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config.*mxfp4"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen3_moe", {"mlp_only_layers": "all"}, "mlp_only_layers"),
    ("qwen3_moe", {"hidden_act": "relu2"}, "hidden_act"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts"),
    ("mixtral", {"num_experts_per_tok": None}, "num_experts_per_tok"),
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config.*mxfp4"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types"),
    ("gpt_oss", {"sliding_window": None}, "sliding_window"),
])
def test_unsupported_moe_config_is_refused_by_name(make_model, tmp_path, arch, changes, named) -> None:
    model = _with_config(make_model(arch), tmp_path, **changes)
    with pytest.raises(ConfigError, match=named):
        EngineConfig.create(model=str(model), device="cpu")


def test_training_only_fields_are_ignored(make_model, tmp_path) -> None:
    model = _with_config(make_model("mixtral"), tmp_path, router_aux_loss_coef=0.5, output_router_logits=True,
                         router_jitter_noise=0.1)
    assert EngineConfig.create(model=str(model), device="cpu").architecture == "MixtralForCausalLM"


def test_expert_parallel_needs_experts_that_split(make_model) -> None:
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model; LlamaForCausalLM"):
        EngineConfig.create(model=str(make_model("llama")), device="cpu", enable_expert_parallel=True)
    with pytest.raises(ConfigError, match=r"num_experts \(8\) divisible by --tensor-parallel-size \(3\)"):
        EngineConfig.create(model=str(make_model("qwen3_moe")), device="cpu", tensor_parallel_size=3,
                            enable_expert_parallel=True)


# ---------------------------------------------------------------------------------------- bfloat16 top-5

TOP_K = 5
BF16_TOKENS = 16
LOGPROB_TOL = 1.0  # per token: a near-tie routing flip moves a logprob by ~0.5 on these tiny models
MEDIAN_LOGPROB_TOL = 0.1  # typical bf16 error here is 0.01-0.15 nats


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_bf16_agrees_with_transformers_within_top5(make_model, arch: str) -> None:
    """tests/gpu/test_bf16_agreement.py's rule on CPU: up to the first differing token the logprobs agree
    within LOGPROB_TOL (their median within MEDIAN_LOGPROB_TOL); there each side's token is in the other's
    top-5. The reference is transformers in float32, not in bfloat16: a MoE model in bf16 flips a near-tie
    routing decision now and then (an expert swapped for another moves the output far more than rounding
    does), and transformers' bf16 (which also rounds the routing weights and sums the experts in bf16) did so
    on these prompts, picking a token outside the float32 model's top-5 where tandem's bf16 kept the float32
    one."""
    model_dir = make_model(arch)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (4, 17, 30)]
    llm = LLM(str(model_dir), dtype="bfloat16", max_num_batched_tokens=32, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=BF16_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    errors: list[float] = []
    for prompt, out in zip(prompts, outs, strict=True):
        got = out.outputs[0]
        ids = list(prompt)
        for i, token in enumerate(got.token_ids):
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            want = int(lp.argmax())
            if token != want:
                ours_top = {tid for tid, _ in got.logprobs[i].top}
                if want not in ours_top:  # a routing flip: then transformers' own bf16 flips the same way
                    _assert_same_flip_as_transformers_bf16(model_dir, ids, token, ours_top, i)
                assert token in lp.topk(TOP_K).indices.tolist(), f"pos {i}: ours {token} not in HF's top-{TOP_K}"
                break
            errors.append(abs(got.logprobs[i].logprob - float(lp[want])))
            ids.append(token)
    assert len(errors) >= BF16_TOKENS  # not vacuous
    assert max(errors) < LOGPROB_TOL and statistics.median(errors) < MEDIAN_LOGPROB_TOL, errors


def _assert_same_flip_as_transformers_bf16(model_dir: Path, ids: list[int], token: int, ours_top: set[int],
                                           pos: int) -> None:
    """Where our bf16 top-5 leaves out float32's choice, transformers in bf16 must have left it out too: the
    same greedy token and the same top-5 (a near-tie routing decision both bf16 models take alike)."""
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        lp16 = torch.log_softmax(hf16(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    assert int(lp16.argmax()) == token, f"pos {pos}: ours {token}, transformers bf16 {int(lp16.argmax())}"
    assert set(lp16.topk(TOP_K).indices.tolist()) == ours_top, f"pos {pos}: top-{TOP_K} differs from HF bf16"
