"""LoRA pieces against references: the batched delta vs a token-by-token loop, slot swapping (LRU among
the adapters a step does not use), TP shards that sum to the whole, and every refused adapter directory
and argument, each with an error naming what is wrong (and nothing loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.lora.manager import LoRAManager, load_adapters
from engine_svc.lora.peft_dir import LoRAAdapterError, load_peft_adapter, module_shapes
from engine_svc.lora.slots import LoRASlots, StepLoRA, lora_delta_reference
from engine_svc.model.loader import load_model
from engine_svc.worker.worker import make_attention_backend
from tests.engine.lora_support import ALL_MODULES, make_adapter


@pytest.mark.parametrize("layout", ["grouped", "onehot"])
@pytest.mark.parametrize("sub_sizes", [[10], [6, 4], [4, 3, 3]])
def test_batched_delta_equals_the_token_loop(sub_sizes: list[int], layout: str) -> None:
    """One projection or a fused one (P sub-projections, each with its own rank block of B), with the
    tokens spread evenly over the slots (the grouped layout) or not (the one-hot layout)."""
    g = torch.Generator().manual_seed(0)
    slots_n, rank, d_in, tokens = 3, 4, 12, 9
    d_out, width = sum(sub_sizes), rank * len(sub_sizes)
    step = StepLoRA()
    slots = LoRASlots(step, slots_n, rank, d_in, sub_sizes, torch.float32, torch.device("cpu"))
    block = torch.zeros(width, d_out)  # B^T's block structure: sub-projection p's ranks -> its columns
    col = 0
    for p, size in enumerate(sub_sizes):
        block[p * rank : (p + 1) * rank, col : col + size] = 1
        col += size
    bs = torch.randn(slots_n, width, d_out, generator=g) * block
    for s in range(slots_n):
        slots.load(s, torch.randn(width, d_in, generator=g), bs[s])
    x = torch.randn(tokens, d_in, generator=g)
    token_slots = torch.tensor([-1, 0, 2, 2, -1, 1, 0, 2, -1] if layout == "grouped" else [0, 0, 0, 0, -1, 0, 0, 1, 2])
    step.plan(token_slots.numpy(), torch.float32, torch.device("cpu"))
    assert (step.group_rows is not None) == (layout == "grouped")
    base = torch.randn(tokens, d_out, generator=g)
    got = slots(x, base.clone())
    want = base + lora_delta_reference(x, token_slots, slots.a, bs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[token_slots < 0], base[token_slots < 0])  # base tokens: exactly the base output
    step.set(None)
    assert torch.equal(slots(x, base.clone()), base)


@pytest.fixture(scope="module")
def adapters(make_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    model_dir = make_model("llama")
    root = tmp_path_factory.mktemp("unit-adapters")
    return model_dir, [make_adapter(model_dir, root / f"a{i}", rank=4, alpha=8, targets=ALL_MODULES, seed=10 + i)
                       for i in range(3)]


def _model(model_dir: Path) -> torch.nn.Module:
    return load_model(str(model_dir), dtype=torch.float32, device=torch.device("cpu"),
                      attn_backend=make_attention_backend("torch"))


def test_slots_swap_lru_among_adapters_the_step_does_not_use(adapters) -> None:
    model_dir, dirs = adapters
    manager = LoRAManager(_model(model_dir), max_loras=2, max_lora_rank=8, device=torch.device("cpu"),
                          dtype=torch.float32, native=False)  # the torch one-hot layout, checked below
    load_adapters(manager, [(f"a{i}", str(d)) for i, d in enumerate(dirs)])
    manager.prepare(np.array([1, 2, 0, 2]))
    assert dict(manager.slot_of) == {1: 0, 2: 1}
    manager.prepare(np.array([2, 2]))  # 2 is now the most recently used
    manager.prepare(np.array([3, 0, 3]))  # evicts 1, the least recently used
    assert dict(manager.slot_of) == {2: 1, 3: 0}
    assert manager.step.num_slots == 1 and manager.step.onehot.tolist() == [[1.0], [0.0], [1.0]]
    qkv = manager.targets[0].slots
    layout = manager.host[3][0]
    assert layout is not None and torch.equal(qkv.a[0], layout[0])
    assert torch.equal(qkv.parts[1][0], layout[1][8:16, 64:96])  # k_proj: the second rank block, the k columns
    manager.prepare(np.array([1, 3]))  # 2 is not used by this step: it goes, 3 stays
    assert dict(manager.slot_of) == {3: 0, 1: 1}
    manager.prepare(np.array([1]))  # 3 is now the least recently used
    manager.prepare(np.array([3, 2]))  # ... but this step needs it: 1 goes
    assert dict(manager.slot_of) == {3: 0, 2: 1}
    with pytest.raises(RuntimeError, match="more than --max-loras 2"):
        manager.prepare(np.array([1, 2, 3]))
    manager.prepare(np.array([0, 0]))
    assert manager.step.num_slots == 0


def test_tp_shards_of_the_slots_sum_to_the_whole(adapters) -> None:
    """Column layers shard B's output rows, row layers A's input columns (two ranks, laid out through the
    layers' own weight loaders): the ranks' deltas concatenate (column) / sum (row) to the TP=1 delta."""
    from engine_svc.lora import manager as manager_mod
    from engine_svc.model.layers.linear import QKVParallelLinear, RowParallelLinear

    model_dir, dirs = adapters
    adapter = load_peft_adapter("a0", str(dirs[0]), max_rank=8, num_layers=2,
                                shapes=module_shapes(_model(model_dir).config))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    full_q = adapter.weights[(0, "q_proj")]
    want_q = (x @ full_q[0].t()) @ full_q[1].t()
    q_rows = []
    for rank in range(2):
        qkv = QKVParallelLinear(64, 16, 4, 2, params_dtype=torch.float32, tp_rank=rank, tp_size=2)
        target = manager_mod._Target(0, qkv, manager_mod._TARGETS[("self_attn", "qkv_proj")], None)  # type: ignore[arg-type]
        m = manager_mod.LoRAManager.__new__(manager_mod.LoRAManager)
        m.rank, m.device, m.dtype = 8, torch.device("cpu"), torch.float32
        target.slots = LoRASlots(StepLoRA(), 1, 8, qkv.in_features, [qkv.q_size, qkv.kv_size, qkv.kv_size],
                                 torch.float32, m.device)
        a, b = m._lay_out(target, adapter)
        q_rows.append(((x @ a.t()) @ b)[:, : qkv.q_size])
    torch.testing.assert_close(torch.cat(q_rows, 1), want_q, rtol=1e-5, atol=1e-5)
    full_o = adapter.weights[(1, "o_proj")]
    x_o = torch.randn(5, 64, generator=g)
    want_o = (x_o @ full_o[0].t()) @ full_o[1].t()
    parts = []
    for rank in range(2):
        o = RowParallelLinear(64, 64, params_dtype=torch.float32, tp_rank=rank, tp_size=2)
        target = manager_mod._Target(1, o, manager_mod._TARGETS[("self_attn", "o_proj")], None)  # type: ignore[arg-type]
        target.slots = LoRASlots(StepLoRA(), 1, 8, o.in_features, [o.out_features], torch.float32, m.device)
        a, b = m._lay_out(target, adapter)
        parts.append((x_o[:, rank * 32 : (rank + 1) * 32] @ a.t()) @ b)
    torch.testing.assert_close(parts[0] + parts[1], want_o, rtol=1e-5, atol=1e-5)


# ---- refused adapter directories -------------------------------------------------------------------
def _copy(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file({**weights, **(tensors or {})} if tensors is not None else weights, str(dst / "adapter_model.safetensors"))
    return dst


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(("case", "error"), [
    ("no config", "adapter_config.json does not exist"),
    ("no weights", "adapter_model.safetensors does not exist"),
    ("rank above max", "r 4 is above --max-lora-rank 1"),
    ("bad rank", "r must be a positive integer"),
    ("dora", "use_dora is True"),
    ("bias", "bias is 'all'"),
    ("wrong shape", "has shape (4, 63), expected (4, 64)"),
    ("non-finite", "holds non-finite values"),
    ("layer past the model", "is for layer 7; the model has 2"),
    ("unknown tensor", "which tandem cannot apply"),
    ("module the model lacks", "targets gate_proj, which this model lacks"),
    ("A without B", "lora_A without its pair"),
    ("not json", "is not valid JSON"),
])
def test_bad_adapter_directories_are_refused(adapters, tmp_path: Path, case: str, error: str) -> None:
    model_dir, dirs = adapters
    src, dst = dirs[0], tmp_path / "bad"
    shapes = module_shapes(_model(model_dir).config)
    max_rank = 8
    weights = load_file(str(src / "adapter_model.safetensors"))
    if case == "no config":
        dst.mkdir()
    elif case == "no weights":
        dst.mkdir()
        (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    elif case == "rank above max":
        _copy(src, dst)
        max_rank = 1
    elif case == "bad rank":
        _copy(src, dst, config={"r": 0})
    elif case == "dora":
        _copy(src, dst, config={"use_dora": True})
    elif case == "bias":
        _copy(src, dst, config={"bias": "all"})
    elif case == "wrong shape":
        _copy(src, dst, tensors={Q_A: torch.zeros(4, 63)})
    elif case == "non-finite":
        bad = weights[Q_A].clone()
        bad[0, 0] = float("nan")
        _copy(src, dst, tensors={Q_A: bad})
    elif case == "layer past the model":
        _copy(src, dst, tensors={Q_A.replace("layers.0", "layers.7"): weights[Q_A]})
    elif case == "unknown tensor":
        _copy(src, dst, tensors={"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
    elif case == "module the model lacks":
        _copy(src, dst)
        shapes = {m: s for m, s in shapes.items() if m != "gate_proj"}
    elif case == "A without B":
        _copy(src, dst)
        save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj.lora_B" not in k},
                  str(dst / "adapter_model.safetensors"))
    elif case == "not json":
        _copy(src, dst)
        (dst / "adapter_config.json").write_text("{r: 4")
    with pytest.raises(LoRAAdapterError, match="'bad'") as info:
        load_peft_adapter("bad", str(dst), max_rank=max_rank, num_layers=2, shapes=shapes)
    assert error in str(info.value)


def test_a_bad_adapter_fails_the_engine_start_naming_it(adapters, tmp_path: Path) -> None:
    from entrypoints import LLM

    model_dir, dirs = adapters
    with pytest.raises(LoRAAdapterError, match=r"LoRA adapter 'broken'.*does not exist"):
        LLM(str(model_dir), dtype="float32", enable_lora=True,
            lora_modules={"good": str(dirs[0]), "broken": str(tmp_path / "missing")})


@pytest.mark.parametrize(("args", "error"), [
    (dict(lora_modules=["a=/x"]), "--lora-modules needs --enable-lora"),
    (dict(enable_lora=True, max_loras=0), "--max-loras 0 must be in"),
    (dict(enable_lora=True, max_lora_rank=7), "--max-lora-rank 7 must be one of"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "--max-cpu-loras 2 must be in"),
    (dict(enable_lora=True, lora_modules=["a=/x", "b=/y"], max_cpu_loras=1), "more than --max-cpu-loras (1)"),
    (dict(enable_lora=True, lora_modules=["a=/x", "a=/y"], max_cpu_loras=2), "'a' is given twice"),
    (dict(enable_lora=True, lora_modules=["novalue"]), "expected name=path"),
    (dict(enable_lora=True, lora_modules=["bad name=/x"]), "--lora-modules name 'bad name'"),
])
def test_lora_arguments_are_bounded(make_model, args: dict, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(model=str(make_model("llama")), **args)
    assert error in str(info.value)


def test_make_demo_lora_writes_a_servable_adapter(make_model, tmp_path: Path) -> None:
    from entrypoints.demo_lora import main

    model_dir = make_model("llama")
    assert main([str(model_dir), str(tmp_path / "demo"), "--rank", "4", "--targets", "q_proj", "down_proj"]) == 0
    adapter = load_peft_adapter("demo", str(tmp_path / "demo"), max_rank=8, num_layers=2,
                                shapes=module_shapes(_model(model_dir).config))
    assert adapter.rank == 4 and adapter.scaling == 4.0
    assert sorted(adapter.weights) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"), (1, "q_proj")]
