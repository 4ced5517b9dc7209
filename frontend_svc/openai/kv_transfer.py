"""`kv_transfer_params` on the OpenAI routes: prefill/decode disaggregation driven from outside (llm-d).

llm-d's routing sidecar (and anything that speaks vLLM's P/D protocol over HTTP) drives two servers: it
sends the client's body to a prefill server with `max_tokens: 1`, `stream: false` and
`kv_transfer_params: {"do_remote_decode": true, ...}`; that server's engine computes the prompt, keeps
its K/V blocks under a lease, and the response carries `kv_transfer_params` naming them
(shared_runtime/kv_transfer_params.py `handoff`, made by pd_flow.kept_kv_params). The sidecar then sends
the client's original body with those params to the decode server, whose engine pulls the blocks
(engine_svc/kv_transfer/) and generates. One disaggregated request is one completion of one prompt: `n`
> 1 or a batch of prompts is refused, naming the field.
"""

from __future__ import annotations

from typing import Any

from frontend_svc.openai.errors import bad_request
from shared_runtime import kv_transfer_params
from shared_runtime.contract import KvTransferParams
from shared_runtime.violations import ValidationError

FIELD = kv_transfer_params.FIELD


def request_params(value: Any, n: int, num_prompts: int, max_model_len: int) -> KvTransferParams | None:
    """The engine's KvTransferParams for a body's `kv_transfer_params` (None when absent or no direction
    is asked); raises ApiError (400) naming the offending key."""
    try:
        params = kv_transfer_params.parse(value, max_model_len)
    except ValidationError as exc:
        violation = exc.violations[0]
        raise bad_request(f"{violation.field} {violation.description}", violation.field) from None
    if params is not None and (n != 1 or num_prompts != 1):
        raise bad_request(f"{FIELD}: a disaggregated request makes one completion of one prompt "
                          f"(n is {n}, prompts {num_prompts})", FIELD)
    return params
