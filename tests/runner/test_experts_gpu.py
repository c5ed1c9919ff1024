"""The grouped-GEMM experts on a GPU (bf16: `torch._grouped_mm` and the SwiGLU kernel) against
the loop over experts in float64, forward and backward, with empty experts among them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("counts", [[5, 0, 17, 42], [64, 64, 64, 64], [0, 0, 130, 0]])
def test_grouped_experts_equal_the_float64_loop(counts):
    from megatron.core.transformer import TransformerConfig

    from mtprun.runner.trainer.experts import GroupedExperts

    config = TransformerConfig(
        num_layers=1, hidden_size=128, num_attention_heads=2, moe_ffn_hidden_size=64,
        num_moe_experts=4, params_dtype=torch.bfloat16, use_cpu_initialization=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(sum(counts))
    experts = GroupedExperts(4, config).cuda()
    with torch.no_grad():
        experts.weight1.copy_(torch.randn(experts.weight1.shape, generator=g) * 0.05)
        experts.weight2.copy_(torch.randn(experts.weight2.shape, generator=g) * 0.05)
    x = torch.randn(sum(counts), 128, generator=g).cuda().bfloat16().requires_grad_(True)
    probs = torch.rand(sum(counts), generator=g).cuda()
    grad_out = torch.randn(sum(counts), 128, generator=g).cuda()
    tokens = torch.tensor(counts)

    out, _ = experts(x, tokens, probs)
    out.float().backward(grad_out)
    reference = GroupedExperts(4, config).double().cuda()
    reference.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
    x64 = x.detach().double().requires_grad_(True)
    want, _ = reference(x64, tokens, probs.double())
    want.backward(grad_out.double())

    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-2, atol=2e-3)
    for name in ("weight1", "weight2"):
        got, ref = getattr(experts, name).grad.double(), getattr(reference, name).grad
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
