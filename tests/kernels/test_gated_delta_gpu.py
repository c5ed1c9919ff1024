"""flash-linear-attention's kernels behind `mtprun.kernels.gated_delta` on a CUDA GPU, against
the float64 references: the gated delta rule forward and every input's gradient, causal conv
forward and gradients, bf16 and float32, packed rows (sequences shorter than a chunk, exactly a
chunk, an empty one, a long one), boundaries on the host or the device, grouped value heads
(fla's own and the torch-backward fallback's). Skipped without a GPU;
needs torch, triton, fla-core, pytest. Measured errors print with `-s`."""

from __future__ import annotations

from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mtprun.kernels.gated_delta import (
    causal_conv1d,
    gated_delta_flops,
    gated_delta_rule,
    require_gdn_kernels,
)
from mtprun.kernels.gated_delta_fla import (
    FLA_BACKWARD,
    TORCH_BACKWARD,
    FlaForwardTorchBackward,
    fla_backward_is_safe,
)
from mtprun.kernels.gated_delta_torch import chunk_gated_delta_rule_torch

from .attention_reference import milliseconds
from .gated_delta_reference import (
    gated_delta_inputs,
    grouped_key_heads,
    reference_causal_conv1d,
    reference_gated_delta,
    relative_error,
    repeat_key_heads,
)

pytestmark = pytest.mark.gpu

NAMES = ("q", "k", "v", "g", "beta")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Relative to the largest reference entry. fla's float32 path multiplies in TF32 (10-bit
# mantissa, ~5e-4 per product); bf16 inputs and outputs round at 4e-3. The reference runs on
# the same rounded inputs, so these cover the kernels' arithmetic only.
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
CASES = {
    "short": [37],
    "one_chunk": [64],
    "packed": [5, 64, 0, 131, 1],
    "long_packed": [1000, 77, 2048],
}


def test_kernels_are_importable_and_name_the_backward() -> None:
    backward = require_gdn_kernels()
    print(f"{torch.cuda.get_device_name()}: gated delta rule backward = {backward}")
    assert backward == (FLA_BACKWARD if fla_backward_is_safe() else TORCH_BACKWARD)


def run_gdn(inputs: dict[str, torch.Tensor], cu_seqlens: torch.Tensor, function):
    """`function`'s output and input gradients and the float64 recurrence's (on the GPU, one
    small launch group per token, from the same rounded inputs): relative errors by name."""
    leaves = {n: inputs[n].cuda().requires_grad_() for n in NAMES}
    out = function(*(leaves[n] for n in NAMES), cu_seqlens)
    assert out.dtype == inputs["v"].dtype and out.device.type == "cuda"
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    out.backward(grad_out.cuda())
    ref_leaves = {n: inputs[n].cuda().double().requires_grad_() for n in NAMES}
    dk = inputs["q"].shape[-1]
    ref = reference_gated_delta(
        *repeat_key_heads(*(ref_leaves[n] for n in NAMES)), cu_seqlens.cpu(), dk**-0.5
    )
    ref.backward(grad_out.cuda().double())
    errors = {"o": relative_error(out, ref)}
    return errors | {n: relative_error(leaves[n].grad, ref_leaves[n].grad) for n in NAMES}


@pytest.mark.parametrize("boundaries", ["host", "device"])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_fla_gated_delta_matches_float64_recurrence(
    case: str, dtype_name: str, boundaries: str
) -> None:
    dtype = DTYPES[dtype_name]
    inputs = gated_delta_inputs(CASES[case], heads=4, dk=128, dv=128, seed=len(case), dtype=dtype)
    cu_seqlens = inputs.pop("cu_seqlens")
    if boundaries == "device":
        cu_seqlens = cu_seqlens.cuda()
    errors = run_gdn(inputs, cu_seqlens, gated_delta_rule)
    print(f"gdn {case} {dtype_name} {boundaries}:", {n: f"{e:.1e}" for n, e in errors.items()})
    for name, error in errors.items():
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_fla_grouped_value_heads_match_float64_recurrence(dtype_name: str) -> None:
    """Qwen3.5's layout: 2 key heads for 4 value heads (value head h reads key head h // 2)."""
    dtype = DTYPES[dtype_name]
    inputs = gated_delta_inputs([5, 64, 300], heads=4, dk=128, dv=128, seed=13, dtype=dtype)
    inputs = grouped_key_heads(inputs, 2)
    cu_seqlens = inputs.pop("cu_seqlens")
    errors = run_gdn(inputs, cu_seqlens, gated_delta_rule)
    print(f"gdn grouped {dtype_name}:", {n: f"{e:.1e}" for n, e in errors.items()})
    for name, error in errors.items():
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_fla_forward_torch_backward_matches_float64_recurrence(
    dtype_name: str, grouped: bool
) -> None:
    """The Hopper fallback (fla forward, torch chunked backward) on any GPU."""
    dtype = DTYPES[dtype_name]
    inputs = gated_delta_inputs([5, 64, 0, 300], heads=4, dk=128, dv=128, seed=9, dtype=dtype)
    if grouped:
        inputs = grouped_key_heads(inputs, 2)
    cu_seqlens = inputs.pop("cu_seqlens")

    def fallback(q, k, v, g, beta, cu_seqlens):
        return FlaForwardTorchBackward.apply(q, k, v, g, beta, cu_seqlens, 128**-0.5, None)[0]

    errors = run_gdn(inputs, cu_seqlens, fallback)
    print(f"fla forward + torch backward {dtype_name}:", {n: f"{e:.1e}" for n, e in errors.items()})
    for name, error in errors.items():
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_fla_causal_conv1d_matches_conv1d_per_sequence(
    dtype_name: str, width: int, activation: str | None
) -> None:
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(width)
    lengths = [1, 3, 0, 300, 2, 64]
    channels = 768  # Qwen3.5-like q, k, v channels of 2 key heads + 2 value heads of 128
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(lengths), channels, generator=generator).to("cuda", dtype)
    weight = torch.randn(channels, width, generator=generator).to("cuda", dtype)
    bias = torch.randn(channels, generator=generator).to("cuda", dtype)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = causal_conv1d(*leaves, cu_seqlens.cuda(), activation=activation)
    assert y.dtype == dtype
    grad_out = torch.randn(y.shape, generator=generator).to("cuda", dtype)
    y.backward(grad_out)
    ref_leaves = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = reference_causal_conv1d(*ref_leaves, cu_seqlens, activation)
    ref.backward(grad_out.double())
    errors = {"y": relative_error(y, ref)}
    for name, ours, expected in zip(("x", "weight", "bias"), leaves, ref_leaves, strict=True):
        errors[name] = relative_error(ours.grad, expected.grad)
    print(f"conv w={width} {activation} {dtype_name}:", {n: f"{e:.1e}" for n, e in errors.items()})
    for name, error in errors.items():
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


def test_speed_report() -> None:
    """Times of a Qwen3.5-sized layer call (bf16, 16 heads of 128, 8192 tokens in 4 sequences):
    fla's forward, the dispatched forward+backward, the torch fallback backward's cost, and the
    matmul throughput `gated_delta_flops` gives the forward. Printed with -s."""
    tokens, heads, dim = 8192, 16, 128
    inputs = gated_delta_inputs([4096, 2048, 1024, 1024], heads, dim, dim, 0, torch.bfloat16)
    cu_seqlens = inputs.pop("cu_seqlens")
    args = [inputs[n].cuda().requires_grad_() for n in NAMES]

    timed = partial(milliseconds, repeats=10)

    def forward_backward(function) -> None:
        function(*args, cu_seqlens).backward(torch.ones_like(args[2]))

    def fallback(*inputs):
        return FlaForwardTorchBackward.apply(*inputs, dim**-0.5, None)[0]

    def torch_only(*inputs):
        return chunk_gated_delta_rule_torch(*inputs, dim**-0.5)

    with torch.no_grad():
        forward_ms = timed(lambda: gated_delta_rule(*args, cu_seqlens))
        torch_forward_ms = timed(lambda: torch_only(*args, cu_seqlens))
    times = {
        "fla forward": forward_ms,
        f"forward+backward ({require_gdn_kernels()})": timed(
            lambda: forward_backward(gated_delta_rule)
        ),
        "fla forward + torch backward": timed(lambda: forward_backward(fallback)),
        "torch forward": torch_forward_ms,
        "torch forward+backward": timed(lambda: forward_backward(torch_only)),
    }
    flops = gated_delta_flops(tokens, heads, dim, dim)
    print(f"\n{torch.cuda.get_device_name()} T={tokens} H={heads} D={dim} bf16:")
    for name, ms in times.items():
        print(f"  {name}: {ms:.3f} ms")
    print(f"  forward matmul throughput {flops / forward_ms / 1e9:.1f} TFLOP/s")
    assert all(ms > 0 for ms in times.values())
