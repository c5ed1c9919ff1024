"""Float64 references and random inputs for the gated delta rule tests (CPU and GPU): the
token-by-token recurrence and F.conv1d per sequence, nothing shared with the code under test."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def reference_gated_delta(q, k, v, g, beta, cu_seqlens, scale: float) -> torch.Tensor:
    """The recurrence, token by token in float64, the state reset at each sequence start:
    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T, o_t = scale S_t^T q_t, a = exp(g).
    Differentiable. q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H] -> [T, H, Dv] float64."""
    return reference_gated_delta_states(q, k, v, g, beta, cu_seqlens, scale)[0]


def reference_gated_delta_states(q, k, v, g, beta, cu_seqlens, scale: float, initial_state=None):
    """`reference_gated_delta` from `initial_state` [S, H, Dk, Dv] (None: zeros): (o [T, H,
    Dv], final states [S, H, Dk, Dv]), float64, differentiable."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    outputs, finals = [], []
    for i, (start, end) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        state = q.new_zeros(heads, dk, dv) if initial_state is None else initial_state[i].double()
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            predicted = torch.einsum("hk,hkv->hv", k[t], state)
            correction = beta[t][:, None] * (v[t] - predicted)
            state = state + k[t][:, :, None] * correction[:, None, :]
            outputs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
        finals.append(state)
    o = torch.stack(outputs) if outputs else v.new_zeros(0, heads, dv)
    return o, torch.stack(finals)


def reference_causal_conv1d(x, weight, bias, cu_seqlens, activation) -> torch.Tensor:
    """F.conv1d (depthwise, W-1 zeros on the left) per sequence, float64. x: [T, C],
    weight: [C, W], bias: [C] or None -> [T, C]."""
    x, weight = x.double(), weight.double()
    bias = None if bias is None else bias.double()
    channels, width = weight.shape
    pieces = []
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        if end == start:
            continue
        seq = x[start:end].T.unsqueeze(0)  # [1, C, L]
        y = F.conv1d(seq, weight.unsqueeze(1), bias, padding=width - 1, groups=channels)
        pieces.append(y[0, :, : end - start].T)
    y = torch.cat(pieces) if pieces else x.new_zeros(0, channels)
    return F.silu(y) if activation is not None else y


def gated_delta_inputs(
    lengths: list[int],
    heads: int,
    dk: int,
    dv: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    decay: float = 1.0,
) -> dict[str, torch.Tensor]:
    """A packed row of len(lengths) sequences with Qwen3.5-like inputs: l2-normalised q, k;
    g = -decay * softplus(N(0,1)) (log decay, float32, mean about -0.8 decay), beta =
    sigmoid(N(0,1)); cu_seqlens int32 on `device`."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    tensors = {
        "q": F.normalize(normal(total, heads, dk), dim=-1),
        "k": F.normalize(normal(total, heads, dk), dim=-1),
        "v": normal(total, heads, dv),
        "g": -decay * F.softplus(normal(total, heads)),
        "beta": normal(total, heads).sigmoid(),
    }
    inputs = {
        name: x.to(device, torch.float32 if name == "g" and dtype != torch.float64 else dtype)
        for name, x in tensors.items()
    }
    bounds = [0, *itertools.accumulate(lengths)]
    inputs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return inputs


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 for an all-zero expectation matched)."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    error = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return error / scale if scale > 0 else error


def grouped_key_heads(inputs: dict[str, torch.Tensor], key_heads: int) -> dict[str, torch.Tensor]:
    """`inputs` with q and k cut to their first `key_heads` heads (grouped value heads)."""
    cut = {name: inputs[name][:, :key_heads].contiguous() for name in ("q", "k")}
    return {**inputs, **cut}


def repeat_key_heads(q, k, v, g, beta) -> tuple[torch.Tensor, ...]:
    """The reference's inputs with q and k repeated to the value heads (value head h reads
    key head h // groups); a no-op when they already have as many heads."""
    groups = v.shape[1] // q.shape[1]
    return q.repeat_interleave(groups, 1), k.repeat_interleave(groups, 1), v, g, beta
