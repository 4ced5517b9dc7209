"""What every node of one engine must agree on: the model and the flags that shape the workers.

A headless node sends its fingerprint in its HELLO (executor/nodes.py); node 0 compares it with its own
and refuses the node, naming each differing flag, before any worker of that node joins torch.distributed
(a node with another tensor-parallel size would join a world of another size and hang the rendezvous).
Flags that only the engine process reads (scheduling policy, API and served-name flags) and the node's
own place (--node-rank, --master-addr as each node reaches node 0) are not part of it.
"""

from __future__ import annotations

import json
from typing import Any

from engine_svc.config import EngineConfig

FINGERPRINT_FIELDS = (
    "model", "dtype", "device", "tensor_parallel_size", "pipeline_parallel_size", "pp_layer_partition",
    "nnodes", "master_port", "enable_expert_parallel", "block_size", "max_num_seqs", "max_num_batched_tokens",
    "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override",
    "enable_prefix_caching", "attention_backend", "enforce_eager", "seed", "async_scheduling",
    "speculative_config", "enable_lora", "lora_modules", "max_loras", "max_lora_rank",
)


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (str, int, float, bool)) else repr(value)


def fingerprint(config: EngineConfig) -> dict[str, Any]:
    """The fields of FINGERPRINT_FIELDS, as JSON-able values (others by their repr)."""
    return {name: _plain(getattr(config, name)) for name in FINGERPRINT_FIELDS}


def encode_fingerprint(config: EngineConfig) -> bytes:
    return json.dumps(fingerprint(config), sort_keys=True).encode()


def fingerprint_mismatch(ours: EngineConfig, theirs: bytes, node_rank: int) -> str | None:
    """None when node `node_rank`'s encoded fingerprint equals node 0's (`ours`), else a message naming
    every differing flag with both values."""
    try:
        other = json.loads(theirs.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        other = None
    if not isinstance(other, dict):
        return f"node {node_rank} sent no readable configuration: run the same tandem version on every node"
    mine = fingerprint(ours)
    differing = [f"--{name.replace('_', '-')} (node 0: {mine[name]!r}, node {node_rank}: {other.get(name)!r})"
                 for name in FINGERPRINT_FIELDS if mine[name] != other.get(name)]
    if not differing:
        return None
    return (f"node {node_rank} runs with other flags than node 0: " + "; ".join(differing)
            + ". Start every node with the same model and parallel flags")
