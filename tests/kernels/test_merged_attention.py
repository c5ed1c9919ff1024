"""`merged_attention` on the CPU (torch's flash attention as the block kernel): output and
q/k/v gradients against a float64 masked softmax, random pieces with and without a block
before the diagonal, grouped-query heads taken by the kernel or repeated; the cuDNN kernel's
calls against the installed torch's op schemas (meta tensors); bad pieces refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mtprun.kernels.merged_attention import (
    CPU_FLASH,
    CUDNN,
    Piece,
    _block_grads,
    block_kernel,
    merged_attention,
)


def _random_pieces(queries: int, count: int, g: torch.Generator) -> list[Piece]:
    """`count` pieces covering `queries`, every other one seeing up to 20 keys before its
    diagonal, their key ranges one after another (under context parallelism they overlap:
    tests/runner/test_attention.py)."""
    cuts = sorted((torch.randperm(queries - 1, generator=g)[: count - 1] + 1).tolist())
    pieces, key = [], 0
    for a, b in zip([0, *cuts], [*cuts, queries], strict=True):
        before = int(torch.randint(0, 21, (), generator=g)) if a % 2 else 0
        pieces.append(Piece(a, b, key, key + before + b - a))
        key += before + b - a
    return pieces


def _visible(pieces: list[Piece], queries: int, keys: int) -> torch.Tensor:
    visible = torch.zeros(queries, keys, dtype=torch.bool)
    for p in pieces:
        for i in range(p.q_end - p.q_start):
            visible[p.q_start + i, p.k_start : p.diagonal + i + 1] = True
    return visible


def _float64_attention(q, k, v, visible):
    """q [T, H, d], k/v [S, G, d] -> [T, H, dv] under `visible` [T, S]."""
    repeat = q.shape[1] // k.shape[1]
    kh, vh = (t.repeat_interleave(repeat, 1).transpose(0, 1) for t in (k, v))
    scores = q.transpose(0, 1) @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vh).transpose(0, 1)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize(
    ("queries", "count", "heads", "groups", "dim"),
    [(40, 1, 2, 2, 16), (97, 3, 4, 2, 32), (64, 5, 4, 1, 64), (7, 7, 6, 3, 16)],
)
def test_matches_float64_masked_softmax(queries, count, heads, groups, dim, grouped):
    g = torch.Generator().manual_seed(queries * count + heads)
    pieces = _random_pieces(queries, count, g)
    keys = pieces[-1].k_end + 3  # trailing keys no piece sees

    def leaf(n, h):
        return torch.randn(n, h, dim, generator=g, dtype=torch.float64, requires_grad=True)

    q, k, v = leaf(queries, heads), leaf(keys, groups), leaf(keys, groups)
    kernel = replace(CPU_FLASH, grouped=grouped)
    out = merged_attention(q, k, v, pieces, kernel)
    want = _float64_attention(q, k, v, _visible(pieces, queries, keys))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for name, a, b in zip("qkv", got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("grouped", [True, False])
def test_cudnn_calls_fit_the_installed_ops(grouped):
    """Shapes only (meta tensors): the forward's outputs go back into the backward as its
    schema takes them, and grouped key heads get gradients of their own shape."""
    q, grad = (torch.empty(1, 4, 96, 64, device="meta", dtype=torch.bfloat16) for _ in "qg")
    k, v = (torch.empty(1, 2, 160, 64, device="meta", dtype=torch.bfloat16) for _ in "kv")
    out, dq, dk, dv = _block_grads(replace(CUDNN, grouped=grouped), q, k, v, grad, False)
    assert out.shape == dq.shape == q.shape
    assert dk.shape == dv.shape == k.shape


def test_kernel_choice():
    assert block_kernel("cpu", torch.float64) is CPU_FLASH
    assert block_kernel("cuda", torch.float32) is None  # cuDNN: half precision only


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([Piece(0, 4, 0, 4), Piece(5, 8, 4, 7)], r"does not start at query 4"),
        ([Piece(0, 4, 0, 4), Piece(4, 4, 4, 4)], r"or is empty"),
        ([Piece(0, 4, 0, 3)], r"holding at least its 4 queries"),
        ([Piece(0, 4, 8, 12)], r"within the 10 keys"),
        ([Piece(0, 4, 0, 4)], r"cover 4 of the 8 queries"),
    ],
)
def test_bad_pieces_are_refused(pieces, message):
    q = torch.randn(8, 2, 16)
    k = torch.randn(10, 1, 16)
    with pytest.raises(ValueError, match=message):
        merged_attention(q, k, k, pieces)


def test_bad_shapes_are_refused():
    q, k = torch.randn(8, 3, 16), torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match=r"query heads 3 must be a multiple of key heads 2"):
        merged_attention(q, k, k, [Piece(0, 8, 0, 8)])
    with pytest.raises(ValueError, match=r"takes q \[Tq, H, d\]"):
        merged_attention(q[None], k, k, [Piece(0, 8, 0, 8)])
