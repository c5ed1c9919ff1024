"""`grouped_linear` on a GPU in bf16 (`torch._grouped_mm` forward and input gradient, the
Triton weight-gradient kernel) against float64, and the MoE experts' weight gradients added
into megatron-core's float32 main_grad under its DDP: once, equal to the float64 gradient
summed over micro batches (the DDP hook must not add the dummy gradient again)."""

from __future__ import annotations

import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# bf16 operands, float32 sums: relative to each result's largest entry.
TOLERANCE = 2e-2
COUNTS = [5, 0, 70, 200, 0, 33]  # empty groups, rows off the kernels' 64-row blocks


def _ends(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to("cuda", torch.int32)


def _loop64(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([rows @ weight[e].T for e, rows in enumerate(x.split(counts))])


def _assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float = TOLERANCE) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize(("width_in", "width_out"), [(2048, 1536), (96, 200)])
def test_grouped_linear_matches_float64(width_in: int, width_out: int) -> None:
    from mtprun.kernels.grouped_gemm import grouped_linear

    g = torch.Generator().manual_seed(width_in + width_out)
    rows = sum(COUNTS)
    x = torch.randn(rows, width_in, generator=g).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(len(COUNTS), width_out, width_in, generator=g) * 0.05).cuda()
    weight = weight.bfloat16().requires_grad_()
    dy = torch.randn(rows, width_out, generator=g).cuda().bfloat16()
    out = grouped_linear(x, weight, _ends(COUNTS))
    out.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = _loop64(x64, w64, COUNTS)
    want.backward(dy.double())
    _assert_close(out, want)
    _assert_close(x.grad, x64.grad)
    _assert_close(weight.grad, w64.grad)

    # The weight gradient into a float32 main_grad instead: start + the float64 gradient.
    start = torch.randn(weight.shape, generator=g).cuda()
    weight.main_grad = start.clone()
    weight.grad, x.grad = None, None
    grouped_linear(x, weight, _ends(COUNTS), accumulate_in_main_grad=True).backward(dy)
    assert weight.grad is None  # no DDP hook (no grad_added_to_main_grad): no gradient
    _assert_close(weight.main_grad, start.double() + w64.grad, 1e-5)  # float32 sums
    _assert_close(x.grad, x64.grad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_one_process():
    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel
    from mtprun.spec.parallel import ParallelSection

    init_parallel(ParallelSection(), 0, 1, "127.0.0.1", _free_port())
    yield
    destroy_parallel()


def _ddp_main_grads(fused: bool, micro_batches: list):
    """({name: main_grad in float64}, the experts) after `micro_batches` under megatron-core's
    DDP (bf16 weights, float32 gradient buffer), with gradient-accumulation fusion on or off."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from mtprun.runner.trainer.apex_standins import accumulate_wgrad_in_main_grad
    from mtprun.runner.trainer.experts import GroupedExperts

    config = TransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=2, moe_ffn_hidden_size=192,
        num_moe_experts=len(COUNTS), params_dtype=torch.bfloat16, bf16=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(11)
    experts = GroupedExperts(len(COUNTS), config).cuda()
    with torch.no_grad():
        for weight in (experts.weight1, experts.weight2):
            weight.copy_(torch.randn(weight.shape, generator=g) * 0.05)
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=experts,
    )
    if fused:
        accumulate_wgrad_in_main_grad(experts)
    assert experts.gradient_accumulation_fusion == fused
    ddp.zero_grad_buffer()
    for x, probs, grad_out in micro_batches:
        out, _ = ddp(x, torch.tensor(COUNTS), probs)
        out.backward(grad_out)
    grads = {"weight1": experts.weight1, "weight2": experts.weight2}
    for name, weight in grads.items():
        assert weight.grad is None  # DDP's hook took every gradient
        grads[name] = weight.main_grad.double().clone()
    return grads, experts


def test_experts_add_their_gradients_into_main_grad_once(megatron_one_process) -> None:
    from mtprun.runner.trainer.experts import GroupedExperts

    g = torch.Generator().manual_seed(5)
    rows = sum(COUNTS)
    micro_batches = [
        (
            torch.randn(rows, 256, generator=g).cuda().bfloat16(),
            torch.rand(rows, generator=g).cuda(),
            torch.randn(rows, 256, generator=g).cuda().bfloat16(),
        )
        for _ in range(2)
    ]
    unfused, _ = _ddp_main_grads(False, micro_batches)
    fused, experts = _ddp_main_grads(True, micro_batches)

    reference = GroupedExperts(len(COUNTS), experts.config).double().cuda()
    reference.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
    for x, probs, grad_out in micro_batches:
        out, _ = reference(x.double(), torch.tensor(COUNTS), probs.double())
        out.backward(grad_out.double())
    for name in ("weight1", "weight2"):
        want = getattr(reference, name).grad
        _assert_close(fused[name], want)
        _assert_close(unfused[name], want)
        # Closer to each other than to float64: the same bf16 activations, summed in float32.
        _assert_close(fused[name], unfused[name], 1e-2)
