"""Probe (next lease): torch's varlen_attn (FA2 varlen) against mtprun's FlexAttention path on
the many-sequence rows of the long-tailed RL batch (balance_gpu.py's shares spend ~0.5 s there).
Prints the signature on this torch, max error against SDPA per sequence, and fwd+bwd ms."""
import inspect, json, sys, time
import torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from mtprun.runner.trainer import attention as A
from mtprun.runner.trainer.context_parallel import TokenShard

try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError as e:
    print("no varlen_attn", e); sys.exit(0)
torch.manual_seed(0)
HQ, HKV, D = 16, 8, 128  # Qwen3-1.7B shape
params = inspect.signature(varlen_attn).parameters
causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
gqa = {"enable_gqa": True} if "enable_gqa" in params else {}

def timed(fn, reps=10):
    fn(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / reps * 1e3

for lengths in ([512] * 64, [300, 900, 1500, 2500, 700, 200] * 5, [2000] * 16 + [100] * 40):
    T = sum(lengths)
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    kk, vv = (x.repeat_interleave(HQ // HKV, 1) for x in (k, v)) if not gqa else (k, v)
    def run_varlen():
        out = varlen_attn(q, kk, vv, cu, cu, max(lengths), max(lengths), **causal, **gqa)
        out.float().sum().backward()
        return out
    ref = torch.cat([F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    err = (run_varlen().float() - ref.float()).abs().max().item()
    mask = A.packed_block_mask(cu.long(), TokenShard(0, 1, T), "cuda")
    def run_flex():  # mtprun's path: [T, 1, heads, d] in, [T, 1, heads * d] out
        out = A._flex(q[:, None], k[:, None], v[:, None], mask)
        out.float().sum().backward()
    flex_err = (A._flex(q[:, None], k[:, None], v[:, None], mask).view(T, HQ, D).float() - ref.float()).abs().max().item()
    row = {"n": len(lengths), "T": T, "varlen_err": err, "flex_err": flex_err,
           "varlen_ms": round(timed(run_varlen), 2), "flex_ms": round(timed(run_flex), 2)}
    print(json.dumps(row))
