"""Packed causal attention on the GPU: the trainer's FlexAttention block mask (with and without
kernel hints and autotuning) against torch's varlen flash attention, cuDNN's ragged attention,
SDPA on a padded [B, S] batch (default, flash and cuDNN backends) and the old dense mask.

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
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention
from triton.testing import do_bench

from mtprun.runner.trainer.attention import _compiled_flex_attention, packed_block_mask
from mtprun.runner.trainer.context_parallel import TokenShard

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


def _flex(tokens: int, seq: int, options: dict | None = None, mode: str | None = None) -> float:
    cu = torch.arange(0, tokens + 1, seq, dtype=torch.int32)
    mask = packed_block_mask(cu, TokenShard(0, 1, tokens), "cuda")
    attend = _compiled_flex_attention()
    if mode:
        attend = torch.compile(flex_attention, dynamic=True, mode=mode)
    return _fwd_bwd_ms(
        lambda q, k, v: attend(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options),
        _inputs(tokens),
    )


def flex(tokens: int, seq: int) -> float:
    return _flex(tokens, seq)


# Every query sees at least itself, and the keys a query block sees are one run of blocks.
PACKED_CAUSAL = {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True}


def flex_packed_causal(tokens: int, seq: int) -> float:
    return _flex(tokens, seq, PACKED_CAUSAL)


def flex_tma(tokens: int, seq: int) -> float:
    return _flex(tokens, seq, {**PACKED_CAUSAL, "USE_TMA": True})


def flex_autotuned(tokens: int, seq: int) -> float:
    return _flex(tokens, seq, PACKED_CAUSAL, mode="max-autotune-no-cudagraphs")


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


def _sdpa(tokens: int, seq: int, backend: SDPBackend | None = None) -> float:
    inputs = [
        t.detach().view(tokens // seq, t.shape[1], seq, DIM).requires_grad_()
        for t in _inputs(tokens)
    ]

    def attend(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k, v = (t.repeat_interleave(HEADS // GROUPS, 1) for t in (k, v))
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return _fwd_bwd_ms(attend, inputs)


def sdpa(tokens: int, seq: int) -> float:
    return _sdpa(tokens, seq)


def sdpa_flash(tokens: int, seq: int) -> float:
    return _sdpa(tokens, seq, SDPBackend.FLASH_ATTENTION)


def sdpa_cudnn(tokens: int, seq: int) -> float:
    return _sdpa(tokens, seq, SDPBackend.CUDNN_ATTENTION)


def cudnn_ragged(tokens: int, seq: int) -> float:
    """cuDNN's packed (ragged) causal attention through aten's op with cumulative sequence
    offsets, keys and values repeated to the query heads; forward + backward ops called
    directly (no autograd wrapper), output checked against SDPA on the padded batch."""
    aten = torch.ops.aten
    cu = torch.arange(0, tokens + 1, seq, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    grad = torch.randn_like(q)
    unused = torch.empty(0, device="cuda")

    def forward():
        return aten._cudnn_attention_forward(q, k, v, None, cu, cu, seq, seq, True, 0.0, True)

    out = forward()[0]
    padded = [t.view(-1, seq, HEADS, DIM).transpose(1, 2) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*padded, is_causal=True).transpose(1, 2).reshape_as(q)
    error = (out.float() - want.float()).abs().max().item()
    if error > 0.05:
        raise AssertionError(f"cuDNN ragged output differs from SDPA by {error:.3g}")

    def step():
        out, lse, _, _, _, _, seed, offset, _ = forward()
        aten._cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, unused, cu, cu, seq, seq, 0.0, True
        )

    return do_bench(step, warmup=50, rep=300, return_mode="median")


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


KERNELS = {
    "flex (trainer)": flex,
    "flex, packed-causal hints": flex_packed_causal,
    "flex, hints + TMA": flex_tma,
    "flex, hints, max-autotune": flex_autotuned,
    "varlen_attn": varlen,
    "cudnn ragged": cudnn_ragged,
    "sdpa [B, S]": sdpa,
    "sdpa [B, S] flash": sdpa_flash,
    "sdpa [B, S] cudnn": sdpa_cudnn,
    "dense mask": dense,
}


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
