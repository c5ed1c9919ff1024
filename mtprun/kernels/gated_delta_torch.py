"""Torch implementations of `mtprun.kernels.gated_delta`: the chunked gated delta rule and the
varlen causal depthwise convolution, for CPU runs and as the readable statement of what the CUDA
kernels compute. Differentiable by autograd."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

CHUNK = 64


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """o [T, H, Dv] of `chunk_gated_delta_rule_states_torch` from zero initial states."""
    o, _ = chunk_gated_delta_rule_states_torch(q, k, v, g, beta, cu_seqlens, scale, None, chunk)
    return o


def chunk_gated_delta_rule_states_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY / UT-transform) gated delta rule in torch, all sequences at once.

    Each sequence is cut into chunks of C = `chunk` tokens (its last chunk zero-padded; padding
    has k = v = 0, g = 0, beta = 0 so it never touches the state, and its outputs are dropped).
    Inside a chunk, with cumulative log decay G_i = sum_{j<=i} g_j, decay matrix
    Gamma_ij = exp(G_i - G_j) (i >= j, else 0) and K_b = diag(beta) K:

        A   = (I + strict_lower(K_b K^T * Gamma))^{-1}          # UT transform, [C, C]
        U   = A V_b,  W = A (exp(G) * K_b)                       # WY representation
        V'  = U - W S                                            # the chunk's corrections
        O   = scale * ((exp(G) * Q) S + (Q K^T * Gamma) V')
        S  <- exp(G_C) S + (exp(G_C - G) * K)^T V'

    so the only sequential part is the last three lines, one step per chunk, batched over the
    sequences that still have a chunk at that step (sequences sorted longest first, so those
    are a prefix). q and k may hold fewer heads than v (grouped value heads: value head h reads
    key head h // (H / Hk)); they are repeated to v's heads first. Computes in float32 (float64
    if v is). Autograd saves the per-chunk tensors of the loop, [S, H, Dk, Dv] states once per
    chunk step plus the [chunks, H, C, C] intra-chunk matrices.

    `initial_state` [S, H, Dk, Dv] (None: zeros) is each sequence's S_0. Returns o [T, H, Dv]
    in v's dtype and the final states [S, H, Dk, Dv] in the compute dtype (an empty sequence's
    is its initial state), both differentiable, as fla's `chunk_gated_delta_rule` with
    `initial_state` and `output_final_state=True`.
    """
    groups = v.shape[1] // q.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    compute = torch.float64 if v.dtype == torch.float64 else torch.float32
    total, heads, dk = k.shape
    dv = v.shape[-1]
    layout = _ChunkLayout.build(cu_seqlens.tolist(), chunk, q.device)
    sequences = len(cu_seqlens) - 1
    if initial_state is None:
        initial_state = q.new_zeros(sequences, heads, dk, dv, dtype=compute)
    initial_state = initial_state.to(compute)
    if layout.n_chunks == 0:
        return v.new_zeros(total, heads, dv), initial_state

    q_c, k_c, v_c = (layout.to_chunks(x.to(compute)) for x in (q, k, v))  # [N, H, C, D]
    g_c, beta_c = (layout.to_chunks(x.to(compute).unsqueeze(-1)).squeeze(-1) for x in (g, beta))
    q_c = q_c * scale
    cum = g_c.cumsum(-1)  # G: [N, H, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gamma = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k_c * beta_c.unsqueeze(-1)
    transform = unit_lower_inverse((k_beta @ k_c.transpose(-1, -2)) * gamma)  # A: [N, H, C, C]
    u = transform @ (v_c * beta_c.unsqueeze(-1))
    w = transform @ (k_beta * cum.exp().unsqueeze(-1))
    intra = (q_c @ k_c.transpose(-1, -2)) * gamma
    q_decayed = q_c * cum.exp().unsqueeze(-1)
    k_decayed = (k_c * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, H, 1, 1]

    # The loop runs on [rows * H, ...] batches with W and exp(G) Q stacked so that one bmm
    # reads the state for both: few ops per step, since the loop is bound by per-op overhead.
    # One split per tensor rather than a slice per step: a slice's backward writes a zero
    # tensor of the full size, which made the backward quadratic in the number of steps.
    reads = torch.cat([w, q_decayed], dim=-2)  # [N, H, 2C, Dk]
    per_step = (
        x.flatten(0, 1).split([n * heads for n in layout.active])
        for x in (reads, u, intra, chunk_decay, k_decayed)
    )
    order = torch.tensor(layout.order, device=q.device)
    state = initial_state.index_select(0, order).flatten(0, 1)  # sorted sequences x heads
    outputs, finished = [], []  # finished: states of the sequences each step leaves behind
    for reads_j, u_j, intra_j, decay_j, k_j in zip(*per_step, strict=True):
        finished.append(state[u_j.shape[0] :])
        state = state[: u_j.shape[0]]
        read = torch.bmm(reads_j, state)  # [W S; exp(G) Q S]
        v_new = u_j - read[:, :chunk]
        outputs.append(torch.baddbmm(read[:, chunk:], intra_j, v_new))
        state = torch.baddbmm(state * decay_j, k_j, v_new)
    o_chunks = torch.cat(outputs).unflatten(0, (layout.n_chunks, heads))
    # Shorter sequences finish at earlier steps: the last step's rows come first in sorted order.
    final = torch.cat([state, *reversed(finished)]).unflatten(0, (len(layout.order), heads))
    final = initial_state.index_copy(0, order, final)  # empty sequences keep their S_0
    return layout.from_chunks(o_chunks).to(v.dtype), final


def unit_lower_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """(I + strict_lower(matrix))^{-1} for [..., C, C] (C a power of two), only the strictly
    lower triangle of `matrix` read.

    Block recursion on the diagonal blocks, sizes 1, 2, 4, ... C:
        [[A, 0], [B, D]]^{-1} = [[A^{-1}, 0], [-D^{-1} B A^{-1}, D^{-1}]]
    i.e. log2(C) rounds of batched matmuls (torch's batched triangular solve is ~30x slower on
    CPU for chunk-sized blocks); fla merges its 16x16 inverses the same way.
    """
    size = matrix.shape[-1]
    if size & (size - 1):
        raise ValueError(f"unit_lower_inverse: size {size} is not a power of two")
    strict = matrix.tril(-1)
    inverse = torch.ones(*matrix.shape[:-2], size, 1, 1, dtype=matrix.dtype, device=matrix.device)
    block = 1
    while block < size:
        n = size // (2 * block)
        # The n diagonal blocks of size 2 block, [..., n, 2 block, 2 block].
        tiles = strict.unflatten(-1, (n, 2 * block)).unflatten(-3, (n, 2 * block))
        diagonal = torch.diagonal(tiles, dim1=-4, dim2=-2).movedim(-1, -3)
        upper_inv, lower_inv = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -(lower_inv @ diagonal[..., block:, :block] @ upper_inv)
        top = torch.cat([upper_inv, torch.zeros_like(upper_inv)], dim=-1)
        bottom = torch.cat([corner, lower_inv], dim=-1)
        inverse = torch.cat([top, bottom], dim=-2)
        block *= 2
    return inverse.squeeze(-3)


class _ChunkLayout:
    """Where each packed token sits in the chunked, step-major layout of the torch path.

    Sequences sorted longest first; chunk rows ordered by (chunk step j, sequence), so the
    sequences that have a chunk j (a prefix of the sorted ones) occupy one contiguous range of
    rows, `active[j]` of them, after those of the earlier steps. Padding slots stay zero.
    """

    def __init__(self, chunk: int, slot: torch.Tensor, active: list[int], order: list[int]):
        self.chunk = chunk
        self.slot = slot  # [T]: packed token -> row * C + position in chunk
        self.active = active
        self.n_chunks = sum(active)
        self.order = order  # the non-empty sequences' indices, longest first

    @classmethod
    def build(cls, bounds: list[int], chunk: int, device: torch.device) -> _ChunkLayout:
        spans = [(a, b - a, i) for i, (a, b) in enumerate(itertools.pairwise(bounds)) if b > a]
        spans.sort(key=lambda span: -span[1])
        steps = -(-spans[0][1] // chunk) if spans else 0
        active = [sum(n > j * chunk for _, n, _ in spans) for j in range(steps)]
        first_row = [0]
        for count in active:
            first_row.append(first_row[-1] + count)
        slot = torch.empty(bounds[-1], dtype=torch.long)
        for rank, (start, length, _) in enumerate(spans):
            position = torch.arange(length)
            row = torch.tensor(first_row[:-1])[position // chunk] + rank
            slot[start : start + length] = row * chunk + position % chunk
        return cls(chunk, slot.to(device), active, [i for _, _, i in spans])

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [N, H, C, D], zero in padding slots."""
        padded = x.new_zeros(self.n_chunks * self.chunk, *x.shape[1:]).index_copy(0, self.slot, x)
        return padded.unflatten(0, (self.n_chunks, self.chunk)).transpose(1, 2)

    def from_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, C, D] -> [T, H, D]."""
        return x.transpose(1, 2).flatten(0, 1).index_select(0, self.slot)


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Torch path of `causal_conv1d`: W shifted copies of x, each masked where its shift crosses
    a sequence start (autograd saves x and the masks)."""
    total, _ = x.shape
    width = weight.shape[-1]
    starts = cu_seqlens.to(x.device, torch.long)
    # Position of each token inside its sequence.
    seq_of_token = torch.searchsorted(starts[1:], torch.arange(total, device=x.device), right=True)
    position = torch.arange(total, device=x.device) - starts[seq_of_token]
    xw = x.to(weight.dtype)
    y = xw * weight[:, width - 1]
    for shift in range(1, min(width, total + 1)):
        shifted = F.pad(xw[:-shift], (0, 0, shift, 0)) if shift < total else torch.zeros_like(xw)
        inside = (position >= shift).unsqueeze(-1)
        y = y + shifted.masked_fill(~inside, 0.0) * weight[:, width - 1 - shift]
    if bias is not None:
        y = y + bias
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype)
