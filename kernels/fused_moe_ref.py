"""Torch reference for kernels/fused_moe.py: the experts of a MoE layer, one expert at a time.

Same signature and numerics as `kernels.fused_moe.fused_experts`:
- `w13` [E, 2I, H] holds each expert's gate rows then up rows; `w2` [E, H, I] its down projection;
  optional biases `w13_bias` [E, 2I], `w2_bias` [E, H].
- `topk_ids` [T, K] are expert indices into these E experts; -1 marks a choice this rank does not hold
  (expert parallelism), which contributes nothing. `topk_weights` [T, K] are the routing weights.
- Per (token, choice): h = x @ w13[e]^T (+ bias) and y = act(h) @ w2[e]^T (+ bias), each rounded to the
  activation dtype as a torch linear would; the weighted sum over choices is taken in float32 and
  rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "swigluoai")


def gated_activation(h: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """h [..., 2I] = [gate | up] -> [..., I]. "swigluoai" is gpt-oss's clamped SwiGLU:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit)."""
    half = h.shape[-1] // 2
    gate, up = h[..., :half], h[..., half:]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unsupported MoE activation {activation!r} (supported: {', '.join(ACTIVATIONS)})")


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """hidden [T, H] -> sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]), [T, H]."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in torch.unique(topk_ids).tolist():
        if expert < 0:
            continue
        tokens, choice = torch.where(topk_ids == expert)
        h = F.linear(hidden[tokens], w13[expert], None if w13_bias is None else w13_bias[expert])
        y = F.linear(gated_activation(h, activation, swiglu_alpha, swiglu_limit), w2[expert],
                     None if w2_bias is None else w2_bias[expert])
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, choice, None].float())
    return out.to(hidden.dtype)
