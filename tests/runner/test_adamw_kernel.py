"""The trainer's AdamW: the Triton step (`mtprun.kernels.adamw`) and `TritonAdamW`, with float32
or bfloat16 moments (`trainer.optimizer_state`), against torch's AdamW. Runs on CUDA, or on CPU
under the Triton interpreter (`test_adamw_interpreted.py` runs this module in a process with
TRITON_INTERPRET=1)."""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from mtprun.kernels.adamw import adamw_step_  # after the skip: it imports triton
from mtprun.runner.trainer.triton_adamw import TritonAdamW

HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
BF16_MOMENTS = {**HYPER, "moments_dtype": torch.bfloat16}


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(300,), (7, 5), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE)) for s in shapes]


def _grads(params, steps: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g).to(DEVICE) for p in params] for _ in range(steps)]


def _run(optimizer, params, grads) -> None:
    for step_grads in grads:
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()


@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_float32_moments_step_exactly_as_torch_adamw(grad_scale: float) -> None:
    params, reference = _params(0), _params(0)
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    torch_adamw = torch.optim.AdamW(reference, **HYPER)
    for step, grads in enumerate(_grads(params, 3, seed=1), start=1):
        for param, ref, grad, (m, v) in zip(params, reference, grads, moments, strict=True):
            with torch.no_grad():
                adamw_step_(
                    param, grad, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.1, step=step, seed=step, grad_scale=grad_scale,
                )  # fmt: skip
            ref.grad = grad * grad_scale
        torch_adamw.step()
    for param, ref, (m, v) in zip(params, reference, moments, strict=True):
        torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m, torch_adamw.state[ref]["exp_avg"], rtol=1e-6, atol=1e-7)
        # torch's CUDA AdamW and the kernel contract g * g + v differently (FMA): 1.3e-5
        # relative was seen on an H200 (run58).
        torch.testing.assert_close(v, torch_adamw.state[ref]["exp_avg_sq"], rtol=5e-5, atol=1e-8)


def test_float32_moments_and_the_model_copy_step_as_torch_adamw() -> None:
    params, reference = _params(8), _params(8)
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    ours, theirs = TritonAdamW(params, **HYPER), torch.optim.AdamW(reference, **HYPER)
    ours.model_weights = lambda: dict(zip(params, copies, strict=True))
    grads = _grads(params, 3, seed=9)
    _run(ours, params, grads)
    _run(theirs, reference, grads)
    for param, ref, model_copy in zip(params, reference, copies, strict=True):
        state = ours.state[param]
        assert state["exp_avg"].dtype == torch.float32 and int(state["step"]) == 3
        torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state["exp_avg"], theirs.state[ref]["exp_avg"])
        # The bf16 weights the model computes with: the master rounded to nearest, as
        # megatron-core's copy after the step rounds them.
        assert torch.equal(model_copy, param.detach().to(torch.bfloat16))


def test_the_model_copy_rounds_ties_to_even_as_torch_does() -> None:
    # lr 0 leaves the master as it was: its copy is then exactly torch's cast of it.
    ulp = 2.0**-7  # bf16's spacing in [1, 2)
    halfway = [1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 1 + ulp / 2 + 2.0**-20, 0.1]
    param = torch.tensor(halfway, device=DEVICE)
    grad, m, v = (torch.zeros_like(param) for _ in range(3))
    model_copy = torch.empty_like(param, dtype=torch.bfloat16)
    hyper = {"lr": 0.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    adamw_step_(param, grad, m, v, **hyper, step=1, seed=0, model_copy=model_copy)
    assert torch.equal(model_copy, param.to(torch.bfloat16))


def test_bf16_moments_track_torch_adamw() -> None:
    params, reference = _params(2), _params(2)
    ours, theirs = TritonAdamW(params, **BF16_MOMENTS), torch.optim.AdamW(reference, **HYPER)
    grads = _grads(params, 5, seed=3)
    _run(ours, params, grads)
    _run(theirs, reference, grads)
    for param, ref in zip(params, reference, strict=True):
        state = ours.state[param]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["step"].device.type == "cpu" and int(state["step"]) == 5
        # Five updates of about lr each: they agree to a few percent of one.
        torch.testing.assert_close(param, ref, rtol=0, atol=5e-4)
        # Each step rounds the moments by up to one bf16 ulp (2^-8 relative, near 1).
        torch.testing.assert_close(
            state["exp_avg"].float(), theirs.state[ref]["exp_avg"], rtol=2e-2, atol=4e-3
        )


def test_a_grad_scale_divides_the_gradients() -> None:
    # How the clip coefficient reaches the step (clip_in_step.py): torch's `grad_scale`.
    scaled, plain = _params(3), _params(3)
    grads = _grads(scaled, 2, seed=4)
    divided = TritonAdamW(scaled, **BF16_MOMENTS)
    divided.grad_scale = torch.tensor(4.0)
    _run(divided, scaled, grads)
    _run(TritonAdamW(plain, **BF16_MOMENTS), plain, [[g / 4 for g in step] for step in grads])
    for a, b in zip(scaled, plain, strict=True):
        assert torch.equal(a, b)


def test_stochastic_rounding_keeps_the_second_moment_unbiased() -> None:
    # A constant gradient: v_t = (1 - beta2^t) g^2. Past ~400 steps its per-step increase is
    # under half a bf16 ulp, so round-to-nearest stalls near 0.34 g^2; stochastic rounding
    # keeps the expectation.
    steps, beta2 = 600, 0.999
    g = torch.randn(2048, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    param = torch.zeros_like(g)
    m, v = (torch.zeros_like(g, dtype=torch.bfloat16) for _ in range(2))
    for step in range(1, steps + 1):
        adamw_step_(
            param, g, m, v, lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0,
            step=step, seed=step,
        )  # fmt: skip
    want = (1 - beta2**steps) * g.double() ** 2
    assert float((v.double() / want).mean()) == pytest.approx(1.0, abs=0.02)
    nearest = torch.zeros_like(g, dtype=torch.bfloat16)
    for _ in range(steps):
        nearest = (beta2 * nearest.float() + (1 - beta2) * g**2).to(torch.bfloat16)
    assert float((nearest.double() / want).mean()) < 0.85


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.83])
def test_a_moment_rounds_up_as_often_as_it_is_far_from_its_lower_neighbour(fraction) -> None:
    # beta1 = 0 stores the gradient itself as the first moment. Every positive bf16 value
    # from 2^-31 to 2^31 (7936), each `fraction` of the way to the next: the hash of seed and
    # value must round about that share of them up, whatever their high bits (binomial sd
    # <= 0.0057).
    bits = torch.arange(0x3000, 0x4F00, dtype=torch.int16)
    low = bits.view(torch.bfloat16).float()
    high = (bits + 1).view(torch.bfloat16).float()
    grad = (low + fraction * (high - low)).to(DEVICE)
    m, v = (torch.zeros_like(grad, dtype=torch.bfloat16) for _ in range(2))
    hyper = {"lr": 0.0, "beta1": 0.0, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    seed = random.randrange(2**31)
    adamw_step_(torch.zeros_like(grad), grad, m, v, **hyper, step=1, seed=seed)
    stored = m.float().cpu()
    up = (stored > low).double().mean()
    assert float(up) == pytest.approx(fraction, abs=0.025), f"seed {seed}"
    assert bool(((stored == low) | (stored == high)).all())


def test_equal_tensors_stay_equal_wherever_they_sit() -> None:
    # Replicas (tp-replicated norms, a tied embedding's copy on another stage) sit at other
    # offsets of other shards: the rounding depends on the values, not the position.
    g = torch.Generator().manual_seed(5)
    p, grad = torch.randn(3000, generator=g), torch.randn(3000, generator=g)
    m = torch.randn(3000, generator=g).to(torch.bfloat16)
    v = torch.rand(3000, generator=g).to(torch.bfloat16)
    a = [t.clone().to(DEVICE) for t in (p, grad, m, v)]
    pad = [torch.zeros(17, dtype=t.dtype) for t in (p, grad, m, v)]
    b = [torch.cat([z, t]).to(DEVICE) for z, t in zip(pad, (p, grad, m, v), strict=True)]
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    adamw_step_(*a, **hyper, step=3, seed=7)
    adamw_step_(*b, **hyper, step=3, seed=7)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y[17:])


def test_a_loaded_state_keeps_bf16_moments_and_continues_exactly() -> None:
    params = _params(6)
    optimizer = TritonAdamW(params, **BF16_MOMENTS)
    grads = _grads(params, 5, seed=7)
    _run(optimizer, params, grads[:2])
    saved = copy.deepcopy(optimizer.state_dict())
    shared = torch.tensor(2.0)  # megatron-core's load gives every parameter this one tensor
    for state in saved["state"].values():
        state["step"] = shared
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = TritonAdamW(resumed_params, **BF16_MOMENTS)
    resumed.load_state_dict(saved)
    state = resumed.state[resumed_params[0]]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["step"].device.type == "cpu"
    _run(optimizer, params, grads[2:])
    _run(resumed, resumed_params, grads[2:])
    for param, other in zip(params, resumed_params, strict=True):
        assert torch.equal(param, other)


def test_bad_moments_are_refused() -> None:
    p = torch.zeros(8, device=DEVICE)
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    bf16 = torch.zeros(8, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must both be float32 or both bfloat16"):
        adamw_step_(p, p, bf16, torch.zeros_like(p), **hyper, step=1, seed=0)
    with pytest.raises(ValueError, match=r"moments are float32 or bfloat16, not torch\.float16"):
        TritonAdamW([torch.nn.Parameter(p)], moments_dtype=torch.float16)
    strided = torch.zeros(16, device=DEVICE)[::2]
    with pytest.raises(ValueError, match="contiguous tensors of one shape"):
        adamw_step_(p, strided, bf16, bf16, **hyper, step=1, seed=0)
