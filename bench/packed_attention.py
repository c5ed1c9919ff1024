"""Packed causal attention on the GPU: the trainer's FlexAttention block mask against torch's
varlen flash attention, SDPA on a padded [B, S] batch and the old dense [T, T] mask.

One attention layer, forward + backward, over `--tokens` packed tokens of equal sequences,
bf16, Qwen2.5-1.5B's heads (12 query / 2 key-value heads of 128). Prints one JSON line per
(sequence length, kernel) and a table; the dense mask runs on 4096-token micro batches (the
old trainer's limit) and is scaled to the same token count.

    python bench/packed_attention.py                  # on the GPU machine
    python bench/packed_attention.py --seq 512,2048,8192 --tokens 16384
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from mtprun.runner.attention import _compiled_flex_attention, packed_block_mask
from mtprun.runner.context_parallel import TokenShard

HEADS, GROUPS, DIM = 12, 2, 128


def _inputs(tokens: int, batch: int = 1) -> list[torch.Tensor]:
    shapes = [
        (batch, HEADS, tokens, DIM),
        (batch, GROUPS, tokens, DIM),
        (batch, GROUPS, tokens, DIM),
    ]
    return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes]


def _fwd_bwd_ms(fn, inputs: list[torch.Tensor]) -> float:
    grad = None

    def step():
        nonlocal grad
        out = fn(*inputs)
        grad = torch.randn_like(out) if grad is None else grad
        out.backward(grad)

    return do_bench(step, warmup=50, rep=300, return_mode="median")


def flex(tokens: int, seq: int) -> float:
    cu = torch.arange(0, tokens + 1, seq, dtype=torch.int32)
    mask = packed_block_mask(cu, TokenShard(0, 1, tokens), "cuda")
    attend = _compiled_flex_attention()
    return _fwd_bwd_ms(
        lambda q, k, v: attend(q, k, v, block_mask=mask, enable_gqa=True), _inputs(tokens)
    )


def varlen(tokens: int, seq: int) -> float:
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.arange(0, tokens + 1, seq, dtype=torch.int32, device="cuda")
    shapes = [(tokens, HEADS, DIM), (tokens, GROUPS, DIM), (tokens, GROUPS, DIM)]
    inputs = [
        torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes
    ]

    # Causal is `window_size=(-1, 0)` in newer torch, `is_causal=True` in older.
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = "enable_gqa" in params

    def attend(q, k, v):
        if not gqa:  # an older torch: repeat the key/value heads
            k, v = (t.repeat_interleave(HEADS // GROUPS, 1) for t in (k, v))
        return varlen_attn(
            q, k, v, cu, cu, seq, seq, **causal, **({"enable_gqa": True} if gqa else {})
        )

    return _fwd_bwd_ms(attend, inputs)


def sdpa(tokens: int, seq: int) -> float:
    inputs = [
        t.detach().view(tokens // seq, t.shape[1], seq, DIM).requires_grad_()
        for t in _inputs(tokens)
    ]
    return _fwd_bwd_ms(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        inputs,
    )


def dense(tokens: int, seq: int, micro: int = 4096) -> float:
    if seq > micro:
        return float("nan")
    pos = torch.arange(micro, device="cuda")
    seq_id = pos // seq
    masked = (seq_id[:, None] != seq_id[None, :]) | (pos[None, :] > pos[:, None])
    q, k, v = _inputs(micro)

    def attend(q, k, v):
        k, v = (t.repeat_interleave(HEADS // GROUPS, 1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)).float() / DIM**0.5
        return scores.masked_fill(masked, float("-inf")).softmax(-1).to(q.dtype) @ v

    return _fwd_bwd_ms(attend, [q, k, v]) * tokens / micro


KERNELS = {"flex (trainer)": flex, "varlen_attn": varlen, "sdpa [B, S]": sdpa, "dense mask": dense}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq", default="512,2048,8192")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for seq in (int(s) for s in args.seq.split(",")):
        row = {"seq": seq, "tokens": args.tokens}
        for name, fn in KERNELS.items():
            try:
                row[name] = round(fn(args.tokens, seq), 3)
            except Exception as error:  # report the others
                row[name] = f"{type(error).__name__}: {error}"[:120]
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\nms per layer, forward + backward, bf16, 12/2 heads of 128")
    print("| seq | " + " | ".join(KERNELS) + " |")
    print("|---" * (len(KERNELS) + 1) + "|")
    for row in rows:
        print(f"| {row['seq']} | " + " | ".join(str(row[k]) for k in KERNELS) + " |")


if __name__ == "__main__":
    main()
