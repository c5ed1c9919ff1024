"""The torch gated delta rule and varlen causal conv (`mtprun.kernels.gated_delta`, CPU path)
against float64 references: forward and every input's gradient, sequences shorter than a chunk,
exactly a chunk, non-multiples, several packed (an empty one among them); given initial states
and the final states (and their gradients); packing equals running apart; equality with
transformers' chunked Qwen3.5 function; the FLOP helper against torch's FLOP counter; bad inputs
answered by clear errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mtprun.kernels.gated_delta import (
    causal_conv1d,
    gated_delta_flops,
    gated_delta_rule,
    gated_delta_rule_states,
    require_gdn_kernels,
)
from mtprun.kernels.gated_delta_torch import unit_lower_inverse

from .gated_delta_reference import (
    gated_delta_inputs,
    grouped_key_heads,
    reference_causal_conv1d,
    reference_gated_delta,
    reference_gated_delta_states,
    relative_error,
    repeat_key_heads,
)

FLOAT32_TOLERANCE = 1e-5
NAMES = ("q", "k", "v", "g", "beta")
# name: (sequence lengths, heads, Dk, Dv)
CASES = {
    "one_token": ([1], 2, 32, 16),
    "short": ([37], 2, 32, 16),
    "one_chunk": ([64], 2, 32, 16),
    "chunk_and_a_bit": ([77], 2, 32, 16),
    "three_chunks": ([192], 2, 32, 16),
    "packed": ([5, 64, 0, 131], 2, 32, 16),
    "packed_many": ([3, 70, 1, 64, 17], 2, 32, 16),
    "qwen3_5_heads": ([100, 64], 2, 128, 128),
}


def run_both(inputs: dict[str, torch.Tensor], scale: float | None = None):
    """(ours, float64 reference) outputs and the gradients of <o, do> for the same random do."""
    leaves = {name: inputs[name].clone().requires_grad_() for name in NAMES}
    cu_seqlens = inputs["cu_seqlens"]
    out = gated_delta_rule(*(leaves[n] for n in NAMES), cu_seqlens, scale=scale)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad_out.to(out.dtype))
    ref_leaves = {name: inputs[name].double().requires_grad_() for name in NAMES}
    dk = inputs["q"].shape[-1]
    ref = reference_gated_delta(
        *repeat_key_heads(*(ref_leaves[n] for n in NAMES)),
        cu_seqlens,
        dk**-0.5 if scale is None else scale,
    )
    ref.backward(grad_out.double())
    ours = {"o": out, **{name: leaves[name].grad for name in NAMES}}
    expected = {"o": ref, **{name: ref_leaves[name].grad for name in NAMES}}
    return ours, expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradients_match_float64_recurrence(case: str) -> None:
    lengths, heads, dk, dv = CASES[case]
    inputs = gated_delta_inputs(lengths, heads, dk, dv, seed=len(case))
    ours, expected = run_both(inputs)
    assert ours["o"].dtype == torch.float32
    for name, value in ours.items():
        error = relative_error(value, expected[name])
        assert error < FLOAT32_TOLERANCE, f"{name}: relative error {error:.2e}"


def test_grouped_value_heads_read_their_key_head() -> None:
    """q, k at 2 key heads for 4 value heads: value head h reads key head h // 2, the same as
    repeating q and k (whose gradients then sum over each group)."""
    inputs = grouped_key_heads(gated_delta_inputs([70, 33], heads=4, dk=32, dv=16, seed=21), 2)
    assert inputs["q"].shape[1] == 2 and inputs["v"].shape[1] == 4
    ours, expected = run_both(inputs)
    for name, value in ours.items():
        error = relative_error(value, expected[name])
        assert error < FLOAT32_TOLERANCE, f"{name}: relative error {error:.2e}"


def test_float64_is_exact_with_strong_decay_and_custom_scale() -> None:
    """In float64 the chunked algorithm equals the recurrence to rounding, so any residual
    above ~1e-12 would be an algebra slip, not float32 noise. Strong decay (g down to about
    -20) exercises the underflowing exp(G) factors."""
    inputs = gated_delta_inputs(
        [70, 128, 9], heads=3, dk=16, dv=8, seed=3, dtype=torch.float64, decay=4.0
    )
    assert inputs["g"].min() < -10
    ours, expected = run_both(inputs, scale=0.3)
    for name, value in ours.items():
        assert value.dtype == torch.float64
        assert relative_error(value, expected[name]) < 1e-12, name


def test_initial_and_final_states_match_float64_recurrence() -> None:
    """Each sequence starts from its own random state and returns its last one (an empty
    sequence returns its initial state); the gradients of <o, do> + <S_final, dS> reach every
    input and the initial states. Grouped value heads (2 key heads for 4)."""
    lengths = [5, 64, 0, 131, 1]
    inputs = grouped_key_heads(gated_delta_inputs(lengths, heads=4, dk=32, dv=16, seed=17), 2)
    generator = torch.Generator().manual_seed(18)
    initial = 0.5 * torch.randn(len(lengths), 4, 32, 16, generator=generator)
    leaves = {name: inputs[name].clone().requires_grad_() for name in NAMES}
    leaves["h0"] = initial.clone().requires_grad_()
    o, final = gated_delta_rule_states(
        *(leaves[n] for n in NAMES), inputs["cu_seqlens"], initial_state=leaves["h0"]
    )
    assert final.shape == initial.shape and final.dtype == torch.float32
    grad_o = torch.randn(o.shape, generator=generator)
    grad_final = torch.randn(final.shape, generator=generator)
    torch.autograd.backward((o, final), (grad_o, grad_final))
    ref_leaves = {name: x.detach().double().requires_grad_() for name, x in leaves.items()}
    ref_o, ref_final = reference_gated_delta_states(
        *repeat_key_heads(*(ref_leaves[n] for n in NAMES)),
        inputs["cu_seqlens"],
        32**-0.5,
        ref_leaves["h0"],
    )
    torch.autograd.backward((ref_o, ref_final), (grad_o.double(), grad_final.double()))
    assert torch.equal(final[2], initial[2])
    ours = {"o": o, "final": final, **{n: leaves[n].grad for n in leaves}}
    expected = {"o": ref_o, "final": ref_final, **{n: ref_leaves[n].grad for n in leaves}}
    for name, value in ours.items():
        error = relative_error(value, expected[name])
        assert error < FLOAT32_TOLERANCE, f"{name}: relative error {error:.2e}"
    with pytest.raises(ValueError, match=r"initial_state must be \[S=5, H=4, Dk=32, Dv=16\]"):
        gated_delta_rule_states(
            *(inputs[n] for n in NAMES), inputs["cu_seqlens"], initial_state=initial[:, :2]
        )


def test_packing_equals_running_apart() -> None:
    lengths = [50, 64, 129, 2]
    packed = gated_delta_inputs(lengths, heads=4, dk=32, dv=32, seed=11)
    out = gated_delta_rule(*(packed[n] for n in NAMES), packed["cu_seqlens"])
    start = 0
    for length in lengths:
        alone = {n: packed[n][start : start + length] for n in NAMES}
        cu_seqlens = torch.tensor([0, length], dtype=torch.int32)
        expected = gated_delta_rule(*(alone[n] for n in NAMES), cu_seqlens)
        torch.testing.assert_close(out[start : start + length], expected, rtol=1e-6, atol=1e-6)
        start += length


def test_matches_transformers_chunked_qwen3_5() -> None:
    """transformers' torch_chunk_gated_delta_rule (the Qwen3.5 CPU path; one sequence, its own
    l2norm off since our inputs are normalised) and its token recurrence, against ours."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    inputs = gated_delta_inputs([150], heads=4, dk=64, dv=32, seed=5)
    ours = gated_delta_rule(*(inputs[n] for n in NAMES), inputs["cu_seqlens"])
    batched = [inputs[n].unsqueeze(0) for n in NAMES]
    chunked, _ = torch_chunk_gated_delta_rule(*batched)
    recurrent, _ = torch_recurrent_gated_delta_rule(*batched)
    assert relative_error(ours, chunked[0]) < FLOAT32_TOLERANCE
    # Also pins the test's own reference to transformers' semantics (which computes in float32).
    reference = reference_gated_delta(*(inputs[n] for n in NAMES), inputs["cu_seqlens"], 64**-0.5)
    assert relative_error(reference, recurrent[0]) < FLOAT32_TOLERANCE


def test_unit_lower_inverse() -> None:
    generator = torch.Generator().manual_seed(0)
    # Entries of the size the UT system has (beta k_i.k_j decays, |.| < 1); N(0, 1) entries
    # would make the inverse's entries, and so any comparison, blow up.
    matrix = 0.3 * torch.randn(3, 64, 64, generator=generator, dtype=torch.float64)
    unit_lower = torch.eye(64, dtype=torch.float64) + matrix.tril(-1)
    torch.testing.assert_close(
        unit_lower_inverse(matrix), torch.linalg.inv(unit_lower), rtol=1e-10, atol=1e-10
    )
    with pytest.raises(ValueError, match="size 48 is not a power of two"):
        unit_lower_inverse(matrix[:, :48, :48])


def test_flop_helper_counts_the_torch_path_matmuls() -> None:
    """Whole chunks: every matmul of the torch path is one the helper's table lists."""
    tokens, heads, dk, dv = 256, 2, 32, 16
    inputs = gated_delta_inputs([128, 64, 64], heads=heads, dk=dk, dv=dv, seed=1)
    with FlopCounterMode(display=False) as counter:
        gated_delta_rule(*(inputs[n] for n in NAMES), inputs["cu_seqlens"])
    assert counter.get_total_flops() == gated_delta_flops(tokens, heads, dk, dv, chunk=64)


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_matches_conv1d_per_sequence(width: int, activation: str | None) -> None:
    generator = torch.Generator().manual_seed(width)
    lengths = [1, 3, 0, 40, 2]
    channels = 6
    x = torch.randn(sum(lengths), channels, generator=generator, requires_grad=True)
    weight = torch.randn(channels, width, generator=generator, requires_grad=True)
    bias = torch.randn(channels, generator=generator, requires_grad=True)
    cu_seqlens = torch.tensor([0, 1, 4, 4, 44, 46], dtype=torch.int64)
    y = causal_conv1d(x, weight, bias, cu_seqlens, activation=activation)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    expected = reference_causal_conv1d(*leaves, cu_seqlens, activation)
    grad_out = torch.randn(y.shape, generator=generator)
    y.backward(grad_out)
    expected.backward(grad_out.double())
    assert relative_error(y, expected) < FLOAT32_TOLERANCE
    for ours, reference in zip((x, weight, bias), leaves, strict=True):
        assert relative_error(ours.grad, reference.grad) < FLOAT32_TOLERANCE


def test_causal_conv1d_without_bias_keeps_dtype() -> None:
    x = torch.randn(10, 4, dtype=torch.bfloat16)
    weight = torch.randn(4, 4)
    cu_seqlens = torch.tensor([0, 4, 10])
    y = causal_conv1d(x, weight, None, cu_seqlens)
    assert y.dtype == torch.bfloat16
    expected = reference_causal_conv1d(x, weight, None, cu_seqlens, "silu")
    assert relative_error(y, expected) < 1e-2


def test_bad_inputs_are_named() -> None:
    inputs = gated_delta_inputs([10, 6], heads=2, dk=8, dv=4, seed=0)
    q, k, v, g, beta, cu_seqlens = (inputs[n] for n in (*NAMES, "cu_seqlens"))
    with pytest.raises(ValueError, match=r"q and k must both be \[T, Hk, Dk\]"):
        gated_delta_rule(q, k[:, :1], v, g, beta, cu_seqlens)
    with pytest.raises(ValueError, match=r"v must be \[T=16, H, Dv\] with H a multiple of"):
        gated_delta_rule(q, k, v[:5], g, beta, cu_seqlens)
    three = torch.cat([v, v[:, :1]], 1)  # 3 value heads on 2 key heads
    with pytest.raises(ValueError, match=r"multiple of the 2 key heads, got \(16, 3, 4\)"):
        gated_delta_rule(q, k, three, g, beta, cu_seqlens)
    with pytest.raises(ValueError, match=r"beta must be \[T=16, H=2\]"):
        gated_delta_rule(q, k, v, g, beta[:, :1], cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to T=16"):
        gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 12, 10, 16]))
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32/int64 tensor"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens.float())
    x, weight = torch.randn(16, 3), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"activation must be one of .* got 'relu'"):
        causal_conv1d(x, weight, None, cu_seqlens, activation="relu")
    with pytest.raises(ValueError, match=r"x must be \[T, C\] and weight \[C, W\]"):
        causal_conv1d(x, weight.T, None, cu_seqlens)
    with pytest.raises(ValueError, match=r"bias must be \[C=3\]"):
        causal_conv1d(x, weight, torch.zeros(4), cu_seqlens)


def test_missing_fla_names_the_package() -> None:
    """What a CUDA run without fla hears from the trainer's pre-flight call."""
    try:
        import fla  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("fla is installed here")
    with pytest.raises(ImportError, match=r"pip install fla-core==0\.6\.0"):
        require_gdn_kernels()


def test_the_same_boundaries_give_fla_the_same_tensors() -> None:
    """fla caches its chunk plan by the identity of its arguments: every layer of a micro batch
    (one host boundaries tensor) gets the same device and host tensors, a new micro batch new
    ones."""
    from mtprun.kernels.gated_delta_fla import _fla_varlen

    first = torch.tensor([0, 5, 12], dtype=torch.int32)
    varlen = _fla_varlen(first, torch.device("cpu"))
    assert varlen["cu_seqlens"].dtype == torch.int64
    assert varlen["cu_seqlens_cpu"].tolist() == [0, 5, 12]
    again = _fla_varlen(first, torch.device("cpu"))
    assert all(again[name] is varlen[name] for name in varlen)
    other = _fla_varlen(first.clone(), torch.device("cpu"))
    assert other["cu_seqlens"] is not varlen["cu_seqlens"]
