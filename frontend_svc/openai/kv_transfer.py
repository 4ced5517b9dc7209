"""`kv_transfer_params` on the OpenAI routes: prefill/decode disaggregation driven from outside (llm-d).

llm-d's routing sidecar (and anything that speaks vLLM's P/D protocol over HTTP) drives two servers: it
sends the client's body to a prefill server with `max_tokens: 1`, `stream: false` and
`kv_transfer_params: {"do_remote_decode": true, ...}`; that server's engine computes the prompt, keeps
its K/V blocks under a lease, and the response carries `kv_transfer_params` naming them
(`do_remote_prefill: true`, `remote_host`/`remote_port` of the producer engine, `remote_request_id`,
`remote_block_ids`, ...). The sidecar then sends the client's original body with those params to the
decode server, whose engine pulls the blocks (engine_svc/kv_transfer/) and generates.

`request_params` reads the field (vLLM's keys; null means unset, as the sidecar sends them; any other key,
a wrong type, both directions at once, or a pull without its producer is a 400 naming the key);
a response reports the engine's kept blocks as `pd_flow.kept_kv_params` makes them. One disaggregated request
is one completion of one prompt: `n` > 1 or a batch of prompts is refused, naming the field.
"""

from __future__ import annotations

from typing import Any

from frontend_svc.openai.errors import ApiError, bad_request
from shared_runtime.contract import KvTransferParams

FIELD = "kv_transfer_params"
_FLAGS = ("do_remote_decode", "do_remote_prefill")
_TEXTS = ("remote_engine_id", "remote_host", "remote_request_id")
_INTS = ("remote_port", "remote_num_tokens")
_KEYS = (*_FLAGS, *_TEXTS, *_INTS, "remote_block_ids")
_MAX_TEXT = 256  # an engine id, a host name or a request id


def request_params(value: Any, n: int, num_prompts: int, max_model_len: int) -> KvTransferParams | None:
    """The engine's KvTransferParams for a request body's `kv_transfer_params` (None when absent or no
    direction is asked); raises ApiError naming the offending key."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{FIELD} must be an object", FIELD)
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise _bad(unknown[0][:64], f"is not a kv_transfer_params key (known: {', '.join(_KEYS)})")
    fields: dict[str, Any] = {}
    for key, raw in value.items():
        if raw is not None:
            fields[key] = _checked(key, raw, max_model_len)
    params = KvTransferParams(**fields)
    if not (params.do_remote_decode or params.do_remote_prefill):
        return None
    if params.do_remote_decode and params.do_remote_prefill:
        raise _bad("do_remote_prefill", "and do_remote_decode cannot both be true")
    if params.do_remote_prefill:
        missing = [k for k in ("remote_host", "remote_port", "remote_request_id") if not fields.get(k)]
        if missing:
            raise _bad(missing[0], "is required with do_remote_prefill (the producer's response names it)")
    if n != 1 or num_prompts != 1:
        raise bad_request(f"{FIELD}: a disaggregated request makes one completion of one prompt "
                          f"(n is {n}, prompts {num_prompts})", FIELD)
    return params


def _checked(key: str, raw: Any, max_model_len: int) -> Any:
    if key in _FLAGS:
        if not isinstance(raw, bool):
            raise _bad(key, "must be a boolean")
        return raw
    if key in _TEXTS:
        if not isinstance(raw, str) or len(raw) > _MAX_TEXT:
            raise _bad(key, f"must be a string of at most {_MAX_TEXT} characters")
        return raw
    if key in _INTS:
        top = 65535 if key == "remote_port" else max_model_len
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= top:
            raise _bad(key, f"must be an integer in [0, {top}]")
        return raw
    # remote_block_ids: at most one block per token of the context
    if not isinstance(raw, list) or len(raw) > max_model_len or \
            any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 2**31 for b in raw):
        raise _bad(key, f"must be a list of at most {max_model_len} block ids (non-negative integers)")
    return raw


def _bad(key: str, why: str) -> ApiError:
    return bad_request(f"{FIELD}.{key} {why}", f"{FIELD}.{key}")
