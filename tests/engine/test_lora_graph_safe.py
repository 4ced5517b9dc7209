"""The LoRA state a CUDA graph reads stays put (CPU, the kernel path through the interpreter): the token
mapping is one device buffer rewritten in place each step, and swapping adapters in and out of slots
copies into the same slot storage; the torch path is not graph-safe (its layout is chosen on the host)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_svc.lora.manager import LoRAManager, load_adapters
from engine_svc.model.loader import load_model
from engine_svc.worker.worker import make_attention_backend
from kernels._triton import HAS_TRITON
from tests.engine.lora_support import ALL_MODULES, make_adapter


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_mapping_and_slot_storage_never_move(make_model, tmp_path) -> None:
    model_dir = make_model("llama")
    dirs = [make_adapter(model_dir, tmp_path / f"a{i}", rank=4, alpha=8, targets=ALL_MODULES, seed=20 + i)
            for i in range(3)]
    model = load_model(str(model_dir), dtype=torch.float32, device=torch.device("cpu"),
                       attn_backend=make_attention_backend("torch"))
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, device=torch.device("cpu"), dtype=torch.float32,
                          max_num_tokens=8, kernels=True)
    assert manager.graph_safe
    load_adapters(manager, [(f"a{i}", str(d)) for i, d in enumerate(dirs)])
    step = manager.step

    def addresses() -> list[int]:
        return [step.mapping_buffer.data_ptr()] + [t.data_ptr() for tg in manager.targets
                                                    for t in (tg.slots.a, tg.slots.b)]

    before = addresses()
    for ids in ([1, 0, 2, 2], [3, 3, 0], [0, 0], [1, 3, 1, 1, 0, 3, 3, 1]):  # 3 evicts a slot, then 1 back
        manager.prepare(np.array(ids))
        assert addresses() == before
        slots = np.array([manager.slot_of.get(i, -1) for i in ids])
        counts = np.bincount(slots[slots >= 0], minlength=2).tolist()
        assert step.mapping.counts.tolist() == counts
        starts, tokens = step.mapping.starts.tolist(), step.mapping.sorted_tokens.tolist()
        for s in range(2):
            assert tokens[starts[s] : starts[s] + counts[s]] == np.flatnonzero(slots == s).tolist()
        for lora_id, slot in manager.slot_of.items():  # each resident adapter's weights sit in its slot
            layout = manager.host[lora_id][0]
            assert layout is not None and torch.equal(manager.targets[0].slots.a[slot], layout[0])
    with pytest.raises(ValueError, match="capacity 8"):
        manager.prepare(np.ones(9, dtype=np.int64))
    assert not LoRAManager(model, max_loras=2, max_lora_rank=8, device=torch.device("cpu"),
                           dtype=torch.float32).graph_safe
