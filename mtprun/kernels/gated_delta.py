"""Gated delta rule (Gated DeltaNet, Qwen3.5's linear-attention layers) on packed rows.

Packed row: S sequences concatenated along the token axis, boundaries `cu_seqlens` ([S+1],
cu_seqlens[0] = 0, cu_seqlens[S] = T, as flash-attn varlen); every recurrence restarts at each
sequence start. Per sequence and head, with state S_t: [Dk, Dv], S_0 = 0, a_t = exp(g_t):

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T
    o_t = scale * S_t^T q_t

This is fla's `chunk_gated_delta_rule` and transformers' `torch_chunk_gated_delta_rule`
(q, k already l2-normalised; g is the log decay, <= 0).

CUDA tensors go to flash-linear-attention's Triton kernels (package `fla-core`, imported on
first use; `require_gdn_kernels` checks it up front and says which backward runs, see
`mtprun.kernels.gated_delta_fla`); other devices take the torch implementation of the same
chunked algorithm (`mtprun.kernels.gated_delta_torch`).
"""

from __future__ import annotations

import itertools

import torch

from mtprun.kernels.gated_delta_fla import (
    fla_causal_conv1d,
    fla_gated_delta_rule,
    fla_gated_delta_rule_states,
    require_gdn_kernels,
)
from mtprun.kernels.gated_delta_torch import (
    CHUNK,
    causal_conv1d_torch,
    chunk_gated_delta_rule_states_torch,
    chunk_gated_delta_rule_torch,
)

__all__ = [
    "causal_conv1d",
    "gated_delta_flops",
    "gated_delta_rule",
    "gated_delta_rule_states",
    "require_gdn_kernels",
]

CONV_ACTIVATIONS = (None, "silu", "swish")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Gated delta rule over a packed row.

    Args:
        q, k: [T, Hk, Dk], l2-normalised along Dk. Hk may divide the H value heads (grouped
            value heads, Qwen3.5's 16 key heads to 32 value heads): value head h reads key
            head h // (H / Hk), as `repeat_interleave(H // Hk, dim=1)` would give it, without
            the copy.
        v: [T, H, Dv].
        g: [T, H] log decay (<= 0), float32.
        beta: [T, H] write strength, in (0, 1).
        cu_seqlens: [S+1] int32/int64 sequence boundaries (0, ..., T). Pass them on the host
            where the caller has them: the values are then checked, and on CUDA fla plans its
            chunks from them without reading device memory back (a sync per call otherwise).
        scale: query scale, default Dk**-0.5.

    Returns:
        o: [T, H, Dv] in v's dtype (see the module docstring for the recurrence).

    Saved for backward: on CUDA with fla's backward, q, k, v, beta, the chunk-cumulated g
    ([T, H] float32) and the UT transform A ([T, H, 64]), the backward recomputing W, U and the
    chunk states; with the torch backward (Hopper, Triton < 3.7.1) the inputs alone. On CPU
    the torch path keeps its autograd graph (see `chunk_gated_delta_rule_torch`).
    """
    _check_gated_delta_inputs(q, k, v, g, beta, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if q.is_cuda:
        return fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale)
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, cu_seqlens, scale)


def gated_delta_rule_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule` from given initial states, with the final states.

    Args: as `gated_delta_rule`, and `initial_state` [S, H, Dk, Dv] float32, sequence i's S_0
    (None: zeros).

    Returns:
        o: [T, H, Dv] in v's dtype.
        final_state: [S, H, Dk, Dv] float32 (float64 for float64 inputs on the CPU), each
            sequence's state after its last token (an empty sequence's S_0).

    Differentiable in every tensor input, the initial states included, and through the final
    states: fla's `chunk_gated_delta_rule(initial_state=..., output_final_state=True)` on
    CUDA, the torch chunked algorithm elsewhere.
    """
    _check_gated_delta_inputs(q, k, v, g, beta, cu_seqlens)
    sequences, heads, dk, dv = len(cu_seqlens) - 1, v.shape[1], q.shape[-1], v.shape[-1]
    if initial_state is not None and initial_state.shape != (sequences, heads, dk, dv):
        raise ValueError(
            f"gated_delta_rule: initial_state must be [S={sequences}, H={heads}, Dk={dk}, "
            f"Dv={dv}], got {tuple(initial_state.shape)}"
        )
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if q.is_cuda:
        return fla_gated_delta_rule_states(q, k, v, g, beta, cu_seqlens, scale, initial_state)
    return chunk_gated_delta_rule_states_torch(q, k, v, g, beta, cu_seqlens, scale, initial_state)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal convolution over a packed row, its window restarting at each sequence.

        y[t, c] = act(bias[c] + sum_{w=0}^{W-1} weight[c, w] * x[t - (W-1) + w, c])

    where x rows before the start of t's sequence count as 0 (the same as F.conv1d with W-1
    left zero padding, per sequence). x: [T, C], weight: [C, W], bias: [C] or None,
    cu_seqlens: [S+1]; returns [T, C] in x's dtype. activation: "silu" (= "swish") or None.
    Saved for backward: fla keeps x, weight, bias and recomputes the pre-activation; the torch
    path's autograd keeps x's W - 1 masked shifted copies.
    """
    _check_conv_inputs(x, weight, bias, cu_seqlens, activation)
    if x.is_cuda:
        return fla_causal_conv1d(x, weight, bias, cu_seqlens, activation)
    return causal_conv1d_torch(x, weight, bias, cu_seqlens, activation)


def gated_delta_flops(T: int, H: int, Dk: int, Dv: int, chunk: int = CHUNK) -> int:
    """Matmul FLOPs of the chunked gated delta rule's forward (2 per multiply-add).

    Per head and chunk of C tokens, counted as the dense blocks the kernels multiply (causal
    masks not discounted; elementwise work not counted):

        K_b K^T and Q K^T                     2 * 2 C^2 Dk
        UT inverse, block merges 1..C/2       2 C (C^2 - 1) / 3
        W = A K_b', U = A V_b                 2 C^2 Dk + 2 C^2 Dv
        W S, Q S, K'^T V'                     3 * 2 C Dk Dv
        (Q K^T * Gamma) V'                    2 C^2 Dv

    i.e. per token 6 C Dk + 4 C Dv + 6 Dk Dv + 2 (C^2 - 1) / 3, times T tokens and H heads
    (exact for the torch path when every sequence is a whole number of chunks; the padding of a
    sequence's last chunk is not counted). Forward only.
    """
    per_token = 6 * chunk * Dk + 4 * chunk * Dv + 6 * Dk * Dv
    return T * H * per_token + T * H * 2 * (chunk * chunk - 1) // 3


def _check_gated_delta_inputs(q, k, v, g, beta, cu_seqlens) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(
            f"gated_delta_rule: q and k must both be [T, Hk, Dk], got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    total, key_heads, _ = q.shape
    if v.dim() != 3 or v.shape[0] != total or v.shape[1] % key_heads:
        raise ValueError(
            f"gated_delta_rule: v must be [T={total}, H, Dv] with H a multiple of the "
            f"{key_heads} key heads, got {tuple(v.shape)}"
        )
    heads = v.shape[1]
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (total, heads):
            raise ValueError(
                f"gated_delta_rule: {name} must be [T={total}, H={heads}], got {tuple(x.shape)}"
            )
    _check_cu_seqlens("gated_delta_rule", cu_seqlens, total)


def _check_conv_inputs(x, weight, bias, cu_seqlens, activation) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"causal_conv1d: x must be [T, C] and weight [C, W], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"causal_conv1d: bias must be [C={x.shape[1]}], got {tuple(bias.shape)}")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(
            f"causal_conv1d: activation must be one of {CONV_ACTIVATIONS}, got {activation!r}"
        )
    _check_cu_seqlens("causal_conv1d", cu_seqlens, x.shape[0])


def _check_cu_seqlens(where: str, cu_seqlens: torch.Tensor, total: int) -> None:
    """Shape and dtype always; the values only when they are on the host (reading device
    boundaries back would stall the GPU stream once per layer)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{where}: cu_seqlens must be a 1-D int32/int64 tensor, got shape "
            f"{tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}"
        )
    if cu_seqlens.device.type != "cpu":
        return
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"{where}: cu_seqlens must run from 0 to T={total}, got {bounds}")
    if any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"{where}: cu_seqlens must be non-decreasing, got {bounds}")
