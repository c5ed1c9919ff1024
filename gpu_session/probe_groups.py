"""Probe (lease 30b): length groups (one causal SDPA per group of like lengths) against
FlexAttention over the whole row, fwd+bwd ms of one layer (16/8 heads of 128), per limit."""
import json, random
import torch
from triton.testing import do_bench
from itertools import accumulate
from mtprun.runner.trainer import attention as A
from mtprun.runner.trainer.context_parallel import TokenShard
from mtprun.runner.trainer.length_groups import LengthGroups, grouped_attention

HQ, HKV, D = 16, 8, 128
rng = random.Random(0)
ROWS = {
    "mb1": [4626, 159, 561, 8177, 2768],
    "mb2": [1411, 4243, 2490, 1896, 2294, 3584],
    "mb7": [6195, 317, 470, 5118, 332, 3932],
    "mb8": [1604, 2079, 2768, 1876, 2214, 124, 2551, 2760],
    "mb0": [1781, 14522],
    "equal8x2048": [2048] * 8,
    "many41": [37 + (i * 977) % 600 for i in range(41)],
    "sft160": [rng.randint(40, 160) for _ in range(160)],
    "one16k": [16384],
    "long+tiny2": [8000] + [100 + i for i in range(50)],
    "mixed": [3000, 2900, 2800, 200, 180, 3100],
}

def fwd_bwd(fn, inputs):
    g = None
    def step():
        nonlocal g
        out = fn(*inputs)
        g = torch.randn_like(out) if g is None else g
        out.backward(g)
    return round(do_bench(step, warmup=20, rep=200, return_mode="median"), 3)

for name, lengths in ROWS.items():
    T = sum(lengths)
    cu = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32)
    x = [torch.randn(T, 1, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV)]
    full = A.packed_block_mask(cu, TokenShard(0, 1, T), "cuda")
    row = {"row": name, "T": T, "n": len(lengths), "flex": fwd_bwd(lambda q, k, v: A._flex(q, k, v, full), x)}
    for limit in (None, 0.0, 1.25, 1.5, 2.0):
        g = LengthGroups.of(lengths, "cuda", limit)
        row[f"groups{limit}"] = [len(g.shapes), fwd_bwd(lambda q, k, v: grouped_attention(q, k, v, g), x)]
    row["tflops_flex"] = round(4096 * sum(n * n for n in lengths) * 3.5 / row["flex"] / 1e9, 1)
    print(json.dumps(row), flush=True)
