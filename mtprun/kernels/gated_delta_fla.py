"""CUDA path of `mtprun.kernels.gated_delta`: flash-linear-attention's Triton kernels (package
`fla-core`, GPU only, imported lazily), with a torch backward where fla's own is unsafe.

fla 0.6.0 refuses the gated delta rule's backward on Hopper (H100/H200) with Triton in
[3.4.0, 3.7.1): Triton miscompiles its `chunk_bwd_dqkwg` there (fla issue #640; torch 2.8-2.11
pin Triton 3.4-3.6). Unless fla's TileLang backend can take that kernel, such runs use fla's
forward and recompute the layer with the torch chunked algorithm in the backward
(`FlaForwardTorchBackward`): the same gradients, about 10x slower (H200, T = 8192 in 4
sequences, 16 heads of 128, bf16: 34-38 ms forward + backward, bound by host time, against
3.6 ms for fla's backward through TileLang); Triton >= 3.7.1 or `pip install tilelang`
restores fla's backward. TileLang's kernel takes 16-bit inputs only: float32 ones fail its
compile ("Get different layout for b_dq", fla 0.6.0 with TileLang on an H200), so they keep
the torch backward there.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch

from mtprun.kernels.gated_delta_torch import chunk_gated_delta_rule_states_torch

FLA_INSTALL_HINT = (
    "pip install fla-core==0.6.0 (flash-linear-attention's Triton kernels, "
    "https://github.com/fla-org/flash-linear-attention)"
)
FLA_BACKWARD = "fla"
TORCH_BACKWARD = "torch (fla's backward is unsafe on Hopper with Triton < 3.7.1, fla #640)"


def require_gdn_kernels() -> str:
    """Fail early, with the package to install, when the CUDA kernels are not importable, and
    say which backward the gated delta rule will use (`FLA_BACKWARD` or `TORCH_BACKWARD`).

    The trainer calls this before its first step on a CUDA run of a model with Gated DeltaNet
    layers (and may log the answer); on CPU the torch path needs nothing extra.
    """
    try:
        import fla.modules.causal_conv1d
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "Gated DeltaNet layers (Qwen3.5 linear attention) on CUDA need flash-linear-attention's"
            f" kernels, which are not importable ({error}); {FLA_INSTALL_HINT}"
        ) from error
    return FLA_BACKWARD if fla_backward_is_safe() else TORCH_BACKWARD


@functools.cache
def _triton_backward_is_unsafe() -> bool:
    """Hopper with Triton in [3.4.0, 3.7.1): the condition of fla's `chunk_bwd_dqkwg` guard."""
    import fla.utils

    triton_fixed = getattr(fla.utils, "TRITON_ABOVE_3_7_1", False)
    return fla.utils.IS_NVIDIA_HOPPER and fla.utils.TRITON_ABOVE_3_4_0 and not triton_fixed


@functools.cache
def fla_backward_is_safe() -> bool:
    """False where fla 0.6.0 raises in the gated backward (Hopper, Triton in [3.4.0, 3.7.1),
    no TileLang to take the kernel)."""
    return not _triton_backward_is_unsafe() or importlib.util.find_spec("tilelang") is not None


def fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale: float) -> torch.Tensor:
    """fla's chunk_gated_delta_rule on the packed row (batch 1, varlen), or its forward with
    the torch backward where fla's is unsafe (warned once)."""
    if _fla_backward(q.dtype):
        return _fla_forward(q, k, v, g, beta, cu_seqlens, scale)
    o, _ = FlaForwardTorchBackward.apply(q, k, v, g, beta, cu_seqlens, scale, None)
    return o


def _fla_backward(dtype: torch.dtype) -> bool:
    """Whether fla's own backward serves this call (or none is needed); else warn, once, that
    the torch backward will."""
    if not torch.is_grad_enabled():
        return True
    # Where TileLang takes fla's backward (`fla_backward_is_safe`), it takes 16-bit inputs only.
    tilelang = _triton_backward_is_unsafe() and fla_backward_is_safe()
    float32_on_tilelang = dtype == torch.float32 and tilelang
    if require_gdn_kernels() == FLA_BACKWARD and not float32_on_tilelang:
        return True
    if not FlaForwardTorchBackward.warned:
        FlaForwardTorchBackward.warned = True
        which = (
            "torch (float32 inputs: fla's TileLang backward compiles 16-bit ones only)"
            if float32_on_tilelang
            else f"{TORCH_BACKWARD}; upgrade triton to >= 3.7.1 or pip install tilelang for "
            "fla's faster backward"
        )
        warnings.warn(f"gated delta rule backward: {which}", stacklevel=4)
    return False


def _fla_forward(q, k, v, g, beta, cu_seqlens, scale: float) -> torch.Tensor:
    o, _ = _fla_chunk(q, k, v, g, beta, cu_seqlens, scale, None, final_state=False)
    return o


def fla_gated_delta_rule_states(
    q, k, v, g, beta, cu_seqlens, scale: float, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunk_gated_delta_rule from `initial_state` ([S, H, Dk, Dv], None: zeros) with
    the final states ([S, H, Dk, Dv] float32), or its forward with the torch backward where
    fla's is unsafe (warned once, as `fla_gated_delta_rule`)."""
    if initial_state is not None:
        initial_state = initial_state.float()
    if _fla_backward(q.dtype):
        return _fla_forward_states(q, k, v, g, beta, cu_seqlens, scale, initial_state)
    return FlaForwardTorchBackward.apply(q, k, v, g, beta, cu_seqlens, scale, initial_state)


def _fla_forward_states(
    q, k, v, g, beta, cu_seqlens, scale: float, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = _fla_chunk(q, k, v, g, beta, cu_seqlens, scale, initial_state, final_state=True)
    return o, final.float()


def _fla_chunk(
    q, k, v, g, beta, cu_seqlens, scale: float, initial_state, final_state: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's chunk_gated_delta_rule on the packed row (batch 1, varlen): o in v's dtype and,
    with `final_state`, the final states as fla returns them."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final = chunk_gated_delta_rule(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g.unsqueeze(0),
        beta.unsqueeze(0),
        scale=scale,
        initial_state=initial_state,
        output_final_state=final_state,
        **_fla_varlen(cu_seqlens, q.device),
    )
    return o.squeeze(0).to(v.dtype), final


class FlaForwardTorchBackward(torch.autograd.Function):
    """o and the final states from fla's forward kernels; the gradients from the torch chunked
    algorithm, recomputed in the backward (float32) and differentiated by autograd:
    q, k [T, Hk, Dk], v [T, H, Dv], g, beta [T, H], cu_seqlens [S+1], initial_state
    [S, H, Dk, Dv] float32 or None (zeros) -> o [T, H, Dv], final states [S, H, Dk, Dv] float32
    (an unused output's gradient is zero). No collectives. Saved for backward: the inputs only
    (the recomputation's graph lives during this layer's backward alone)."""

    warned = False

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, scale: float, initial_state):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state)
        ctx.scale = scale
        o, final = _fla_forward_states(q, k, v, g, beta, cu_seqlens, scale, initial_state)
        return o, final

    @staticmethod
    def backward(ctx, grad_o, grad_final):
        q, k, v, g, beta, cu_seqlens, initial_state = ctx.saved_tensors
        inputs = (q, k, v, g, beta, initial_state)
        wanted = (*ctx.needs_input_grad[:5], ctx.needs_input_grad[7])
        wanted = tuple(w and x is not None for x, w in zip(inputs, wanted, strict=True))
        with torch.enable_grad():
            leaves = [
                None if x is None else x.detach().requires_grad_(w)
                for x, w in zip(inputs, wanted, strict=True)
            ]
            *tensors, h0 = leaves
            o, final = chunk_gated_delta_rule_states_torch(
                *tensors, cu_seqlens.cpu(), ctx.scale, h0
            )
            needed = [x for x, w in zip(leaves, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad((o, final), needed, (grad_o, grad_final)))
        *first, last = (next(grads) if w else None for w in wanted)
        return (*first, None, None, last)


def fla_causal_conv1d(x, weight, bias, cu_seqlens, activation) -> torch.Tensor:
    """fla's Triton causal_conv1d on the packed row (batch 1, varlen)."""
    require_gdn_kernels()
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(
        x.unsqueeze(0),
        weight=weight,
        bias=bias,
        activation=activation,
        **_fla_varlen(cu_seqlens, x.device),
    )
    return y.squeeze(0).to(x.dtype)


_VARLEN_KEPT = 4
_recent_varlen: list = []  # [(the caller's boundaries, their fla arguments)], newest first


def _fla_varlen(cu_seqlens: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """fla's varlen arguments: int64 boundaries on the device, plus the host copy when the caller
    has one (fla then plans its chunks without reading the boundaries back from the GPU).

    The same boundaries tensor gets the same argument tensors back: fla caches its chunk plans
    by argument identity (`fla.utils.tensor_cache`), so every layer of a micro batch after the
    first, forward and backward, reuses the plan instead of building it again. A few are kept:
    under context parallelism a layer's conv and delta rule each have boundaries of their own.
    """
    for i, (known, varlen) in enumerate(_recent_varlen):
        if known is cu_seqlens and varlen["cu_seqlens"].device == device:
            _recent_varlen.insert(0, _recent_varlen.pop(i))
            return varlen
    varlen = {"cu_seqlens": cu_seqlens.to(device, torch.long)}
    if cu_seqlens.device.type == "cpu":
        varlen["cu_seqlens_cpu"] = cu_seqlens.long()
    _recent_varlen.insert(0, (cu_seqlens, varlen))
    del _recent_varlen[_VARLEN_KEPT:]
    return varlen
