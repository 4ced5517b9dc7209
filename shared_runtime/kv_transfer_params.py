"""vLLM's `kv_transfer_params` object (NIXL's handoff keys) <-> the contract's `KvTransferParams`.

P/D driven from outside speaks vLLM's JSON object: llm-d's sidecar in OpenAI bodies
(frontend_svc/openai/kv_transfer.py), SMG in `kv_transfer_params_json` (engine_svc/api/smg/). The
prefill leg asks `{"do_remote_decode": true, ...}`; its answer names the kept blocks (`handoff`); the
decode leg sends that object back. `parse` reads vLLM's keys only (null = unset, as the callers send
them; another key, a wrong type, both directions, or a pull without its producer is a violation naming
`kv_transfer_params.<key>`), bounded by the context length before anything is built.
"""

from __future__ import annotations

from typing import Any

from shared_runtime.contract import KvTransferParams
from shared_runtime.violations import FieldViolation, ValidationError

FIELD = "kv_transfer_params"
_FLAGS = ("do_remote_decode", "do_remote_prefill")
_TEXTS = ("remote_engine_id", "remote_host", "remote_request_id")
_INTS = ("remote_port", "remote_num_tokens")
KEYS = (*_FLAGS, *_TEXTS, *_INTS, "remote_block_ids")
_MAX_TEXT = 256  # an engine id, a host name or a request id


def parse(value: Any, max_model_len: int) -> KvTransferParams | None:
    """The params an object asks for; None when it asks no direction (absent, or every flag false)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(FIELD, "must be an object")
    unknown = sorted(str(k) for k in set(value) - set(KEYS))
    if unknown:
        raise _bad(f"{FIELD}.{unknown[0][:64]}", f"is not a kv_transfer_params key (known: {', '.join(KEYS)})")
    fields = {key: _checked(key, raw, max_model_len) for key, raw in value.items() if raw is not None}
    params = KvTransferParams(**fields)
    if not (params.do_remote_decode or params.do_remote_prefill):
        return None
    if params.do_remote_decode and params.do_remote_prefill:
        raise _bad(f"{FIELD}.do_remote_prefill", "and do_remote_decode cannot both be true")
    if params.do_remote_prefill:
        missing = [k for k in ("remote_host", "remote_port", "remote_request_id") if not fields.get(k)]
        if missing:
            raise _bad(f"{FIELD}.{missing[0]}", "is required with do_remote_prefill (the prefill's answer names it)")
    return params


def handoff(kept: KvTransferParams) -> dict[str, Any]:
    """What a prefill's answer reports of its engine's kept blocks: the object the decode leg sends."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": kept.remote_engine_id,
            "remote_host": kept.remote_host, "remote_port": kept.remote_port,
            "remote_request_id": kept.remote_request_id, "remote_block_ids": list(kept.remote_block_ids),
            "remote_num_tokens": kept.remote_num_tokens}


def _checked(key: str, raw: Any, max_model_len: int) -> Any:
    path = f"{FIELD}.{key}"
    if key in _FLAGS:
        if not isinstance(raw, bool):
            raise _bad(path, "must be a boolean")
        return raw
    if key in _TEXTS:
        if not isinstance(raw, str) or len(raw) > _MAX_TEXT:
            raise _bad(path, f"must be a string of at most {_MAX_TEXT} characters")
        return raw
    if key in _INTS:
        top = 65535 if key == "remote_port" else max_model_len
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= top:
            raise _bad(path, f"must be an integer in [0, {top}]")
        return raw
    # remote_block_ids: at most one block per token of the context
    if not isinstance(raw, list) or len(raw) > max_model_len or \
            any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 2**31 for b in raw):
        raise _bad(path, f"must be a list of at most {max_model_len} block ids (non-negative integers)")
    return raw


def _bad(path: str, why: str) -> ValidationError:
    return ValidationError([FieldViolation(path, why)])
