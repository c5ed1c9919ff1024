"""Probe (not kept): cp=2 attention at 32k tokens, pieces (cuDNN+lse) vs flex vs cp=1 cuDNN."""
import sys, torch, torch.nn.functional as F
sys.path.insert(0, ".")
from mtprun.runner.trainer.attention import SequencePieces, _flex, _merged_pieces, packed_block_mask
from mtprun.runner.trainer.context_parallel import TokenShard
from mtprun.kernels.merged_attention import block_kernel
T, H, G, D, CP = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), 128, 2
k_ = block_kernel("cuda", torch.bfloat16); print("kernel", k_.name, "grouped", k_.grouped)
def ms(fn, r=5):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(r): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / r
g = torch.Generator("cuda").manual_seed(0)
def draw(*s): return torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)
q, k, v, grad = draw(T, 1, H, D), draw(T, 1, G, D), draw(T, 1, G, D), draw(T, 1, H * D)
cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
shards = [TokenShard(r, CP, T) for r in range(CP)]
k_all, v_all = (torch.cat([t[s.index.cuda()] for s in shards]).requires_grad_() for t in (k, v))
for r, sh in enumerate(shards):
    idx = sh.index.cuda(); ql = q[idx].requires_grad_(); gl = grad[idx]
    pieces = SequencePieces.of(cu, [T], sh, "cuda"); mask = packed_block_mask(cu, sh, "cuda")
    for name, f in (("pieces", lambda: _merged_pieces(ql, k_all, v_all, pieces)), ("flex", lambda: _flex(ql, k_all, v_all, mask))):
        fwd = ms(lambda: f())
        fb = ms(lambda: torch.autograd.grad(f(), (ql, k_all, v_all), gl))
        print(f"rank {r} {name}: fwd {fwd:.2f} ms fwd+bwd {fb:.2f} ms", flush=True)
qw, kw, vw = (t.squeeze(1).transpose(0, 1)[None].requires_grad_() for t in (q, k, v))
gw = grad.view(T, H, D).transpose(0, 1)[None]
f1 = lambda: F.scaled_dot_product_attention(qw, kw, vw, is_causal=True, enable_gqa=True)
print(f"cp=1 whole row sdpa: fwd {ms(f1):.2f} fwd+bwd {ms(lambda: torch.autograd.grad(f1(), (qw, kw, vw), gw)):.2f} ms")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    idx = shards[0].index.cuda(); ql = q[idx].requires_grad_()
    pieces = SequencePieces.of(cu, [T], shards[0], "cuda")
    torch.autograd.grad(_merged_pieces(ql, k_all, v_all, pieces), (ql, k_all, v_all), grad[idx]); torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
