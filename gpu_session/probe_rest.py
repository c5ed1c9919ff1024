"""Probe (lease 30): why FlexAttention on a long-tailed row's short sequences ("rest") runs at
~50-70 TFLOP/s. Rows of draw 0's balanced layout; fwd+bwd ms of one layer (16/8 heads of 128)."""
import sys, json
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from mtprun.runner.trainer import attention as A
from mtprun.runner.trainer.context_parallel import TokenShard
from torch.nn.attention.flex_attention import flex_attention

HQ, HKV, D = 16, 8, 128
ROWS = {
    "mb1": [4626, 159, 561, 8177, 2768],
    "mb2": [1411, 4243, 2490, 1896, 2294, 3584],
    "mb7": [6195, 317, 470, 5118, 332, 3932],
    "mb8": [1604, 2079, 2768, 1876, 2214, 124, 2551, 2760],
}

def fwd_bwd(fn, inputs):
    g = None
    def step():
        nonlocal g
        out = fn(*inputs)
        g = torch.randn_like(out) if g is None else g
        out.backward(g)
    return round(do_bench(step, warmup=20, rep=200, return_mode="median"), 3)

def inputs(T):
    return [torch.randn(T, 1, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV)]

def cu_of(lengths):
    return torch.tensor([0, *__import__("itertools").accumulate(lengths)], dtype=torch.int32)

def tflops(lengths, ms):
    return round(4096 * sum(n * n for n in lengths) * 3.5 / ms / 1e9, 1)

compiled_static = torch.compile(flex_attention, dynamic=False)
for name, lengths in ROWS.items():
    T = sum(lengths); cu = cu_of(lengths); sh = TokenShard(0, 1, T)
    x = inputs(T)
    own = tuple(i for i, n in enumerate(lengths) if n >= A.LONG_SEQUENCE)
    rest_len = [n for n in lengths if n < A.LONG_SEQUENCE]
    row = {"row": name, "T": T, "lengths": lengths}
    mask_now = A.packed_attention_mask(cu, lengths, sh, "cuda")
    def now(q, k, v):
        if isinstance(mask_now, A.SequenceSpans):
            return A._sdpa_spans(q, k, v, mask_now)
        return A._flex(q, k, v, mask_now)
    row["now"] = fwd_bwd(now, x)
    full = A.packed_block_mask(cu, sh, "cuda")
    row["flex_full"] = fwd_bwd(lambda q, k, v: A._flex(q, k, v, full), x)
    every = A.SequenceSpans.of(lengths)
    row["spans_all"] = fwd_bwd(lambda q, k, v: A._sdpa_spans(q, k, v, every), x)
    if own:
        rest = A.packed_block_mask(cu, sh, "cuda", skip=own)
        row["flex_rest_only_fullrow"] = fwd_bwd(lambda q, k, v: A._flex(q, k, v, rest), x)
        # the rest alone, compacted into its own row
        Tr = sum(rest_len); xr = inputs(Tr); cur = cu_of(rest_len)
        compact = A.packed_block_mask(cur, TokenShard(0, 1, Tr), "cuda")
        row["flex_rest_compact"] = fwd_bwd(lambda q, k, v: A._flex(q, k, v, compact), xr)
        row["spans_rest_compact"] = fwd_bwd(lambda q, k, v: A._sdpa_spans(q, k, v, A.SequenceSpans.of(rest_len)), xr)
        def static(q, k, v, m=rest):
            qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            return compiled_static(qq, kk, vv, block_mask=m, enable_gqa=True)
        row["flex_rest_fullrow_static"] = fwd_bwd(static, x)
        row["rest_tflops_fullrow"] = tflops(rest_len, row["flex_rest_only_fullrow"])
        row["rest_tflops_compact"] = tflops(rest_len, row["flex_rest_compact"])
        # kernel time split: forward only
        with torch.no_grad():
            row["flex_rest_fwd_fullrow"] = round(do_bench(lambda: A._flex(*x, rest), warmup=20, rep=200), 3)
            row["flex_rest_fwd_compact"] = round(do_bench(lambda: A._flex(*xr, compact), warmup=20, rep=200), 3)
    row["flex_full_tflops"] = tflops(lengths, row["flex_full"])
    row["spans_all_tflops"] = tflops(lengths, row["spans_all"])
    print(json.dumps(row), flush=True)
