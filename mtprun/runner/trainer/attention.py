"""Packed causal attention: the core attention of every decoder layer.

A micro batch is one packed row of sequences; a query sees the keys of its own sequence up
to itself. `packed_attention_mask` describes that once per micro batch, for the local
queries of a context-parallel rank against the gathered keys of every rank
(`TokenShard.key_positions` order). `PackedAttention` takes it with the rows' rotary angles
(`PackedRows`), rotates q and k (one Triton launch on CUDA, `mtprun.kernels.rope`, instead of
Megatron's eight unfused ops per tensor) and applies the mask:

- CUDA, no context parallelism: the row's sequences in groups of like lengths
  (`LengthGroups`), each group one causal SDPA call on a [count, length] batch, which runs
  cuDNN's fused attention on Hopper; the grouping is the one of least estimated time among a
  few padding limits (`mtprun.runner.trainer.length_groups`). Padding only follows real
  tokens, so causal attention never shows it to them. A row of equal sequences is one group,
  the row itself viewed as the batch; a long-tailed RL row runs its sequences each alone,
  straight on the row; many short sequences run in a few gathered groups. On an H200 (16/8
  heads of 128) this took 0.34-0.58x FlexAttention's time on the rows measured, which
  FlexAttention ran at 6-300 TFLOP/s (bench/RESULTS.md, run 98).
- CUDA, context parallelism, at most SPAN_LIMIT sequences in the row (`SequencePieces`): the
  local queries cut where a sequence meets one of the rank's two chunks; each piece attends
  the gathered keys of its sequence up to its end as a causal diagonal block and an unmasked
  block before it, cuDNN's fused attention on each, merged by log-sum-exp
  (`mtprun.kernels.merged_attention`): cuDNN's speed under context parallelism too, where
  FlexAttention takes 1.5-1.8x its time. float32 (cuDNN takes half precision only) takes
  FlexAttention's block mask instead.
- CUDA, context parallelism with more sequences: FlexAttention with a block mask built from
  the sequences' extents. Block pairs that cross no sequence boundary and lie under the
  diagonal are full (no mask evaluated), pairs in different sequences or above the diagonal
  are skipped, the rest evaluate the mask per element. No [T, T] tensor exists; GQA is
  handled by the kernel.
- CPU: an explicit boolean [1, 1, T_local, cp * width] mask through Megatron-core's local
  attention (unfused softmax; fine at the sizes a CPU trains).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property
from itertools import accumulate
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mtprun.data.device_copy import to_device
from mtprun.kernels.merged_attention import Piece, block_kernel, merged_attention
from mtprun.runner.trainer.context_parallel import TokenShard, gather_keys
from mtprun.runner.trainer.length_groups import LengthGroups, grouped_attention

BLOCK = 128  # FlexAttention's tile along queries and keys
# Sequences of a context-parallel row up to which its local queries run as pieces on cuDNN
# (`SequencePieces`), beyond which FlexAttention takes the row.
SPAN_LIMIT = 4


def _check_row_tokens(covered: int, shard: TokenShard) -> None:
    if covered != shard.num_tokens:
        raise ValueError(
            f"cu_seqlens covers {covered} tokens but the batch has "
            f"{shard.num_tokens}; cu_seqlens[-1] must equal the number of packed tokens"
        )


def _sequence_spans(lengths: list[int]) -> tuple[tuple[int, int], ...]:
    """(start, end) row positions of sequences of `lengths` tokens packed in order."""
    ends = list(accumulate(lengths))
    return tuple(zip([0, *ends[:-1]], ends, strict=True))


@dataclass(frozen=True)
class TokenLayout:
    """Sequence id and row position of each local query and each gathered key (-1 for a
    padding key, which no query sees)."""

    query_seq: torch.Tensor
    query_pos: torch.Tensor
    key_seq: torch.Tensor
    key_pos: torch.Tensor

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, shard: TokenShard, device: Any) -> TokenLayout:
        """The layout of `shard`'s tokens."""
        # Expanded where the boundaries are (the host, from the trainer), then copied: on the
        # GPU, repeat_interleave reads its output size back from the device.
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        seq_id = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
        _check_row_tokens(seq_id.numel(), shard)
        seq_id = to_device(seq_id, device)
        query = to_device(shard.index, device)
        key = to_device(shard.key_positions(), device)
        key_seq = torch.where(key >= 0, seq_id[key.clamp(min=0)], -1)
        query_seq = seq_id[query]
        return cls(query_seq, query, key_seq, key)

    def visible(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Whether query index q sees key index k (broadcasting index tensors)."""
        return (self.query_seq[q] == self.key_seq[k]) & (self.key_pos[k] <= self.query_pos[q])


def packed_causal_mask(cu_seqlens: torch.Tensor, shard: TokenShard, device: Any) -> torch.Tensor:
    """[1, 1, T_local, cp * width] bool, True where a local query must not see a gathered key
    (`shard.key_positions()` order): a key after the query, in another sequence, or padding.
    Without context parallelism that is [1, 1, T, T] over the row."""
    layout = TokenLayout.of(cu_seqlens, shard, device)
    q = torch.arange(layout.query_pos.numel(), device=device)
    k = torch.arange(layout.key_pos.numel(), device=device)
    return (~layout.visible(q[:, None], k[None, :]))[None, None]


def packed_block_mask(cu_seqlens: torch.Tensor, shard: TokenShard, device: Any) -> BlockMask:
    """The same mask as a FlexAttention BlockMask, built from per-block extents of sequence
    ids and positions ([T/128, T/128] work, no [T, T] tensor)."""
    layout = TokenLayout.of(cu_seqlens, shard, device)
    q_seq, q_pos = _block_extents(layout.query_seq), _block_extents(layout.query_pos)
    # Padding keys get sequence id -1 and position -1: a block holding one is never full.
    k_seq, k_pos = _block_extents(layout.key_seq), _block_extents(layout.key_pos)
    same_single_seq = (
        (q_seq[0][:, None] == q_seq[1][:, None])
        & (k_seq[0][None, :] == k_seq[1][None, :])
        & (q_seq[0][:, None] == k_seq[0][None, :])
    )
    full = same_single_seq & (k_pos[1][None, :] <= q_pos[0][:, None]) & (k_pos[0][None, :] >= 0)
    # A block pair whose id ranges do not meet, or whose keys all come after its queries
    # (positions rise with the row position), sees nothing.
    disjoint = (k_seq[1][None, :] < q_seq[0][:, None]) | (k_seq[0][None, :] > q_seq[1][:, None])
    empty = disjoint | (k_pos[0][None, :] > q_pos[1][:, None]) | (k_seq[1][None, :] < 0)
    partial = ~(full | empty)
    num_partial, partial_idx = _ordered(partial)
    num_full, full_idx = _ordered(full)

    def mask_mod(b, h, q_idx, kv_idx):
        return layout.visible(q_idx, kv_idx)

    return BlockMask.from_kv_blocks(
        num_partial,
        partial_idx,
        num_full,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(layout.query_pos.numel(), layout.key_pos.numel()),
    )


def _block_extents(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of `values` over each block of BLOCK consecutive entries (the last block
    may be short)."""
    pad = -values.numel() % BLOCK
    low = torch.nn.functional.pad(values, (0, pad), value=torch.iinfo(values.dtype).max)
    high = torch.nn.functional.pad(values, (0, pad), value=torch.iinfo(values.dtype).min)
    return low.view(-1, BLOCK).amin(1), high.view(-1, BLOCK).amax(1)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[q_blocks, kv_blocks] bool -> (count [1, 1, q_blocks], indices [1, 1, q_blocks,
    kv_blocks]) with each row's True columns first, ascending, as BlockMask takes them."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


def packed_attention_mask(
    cu_seqlens: torch.Tensor, lengths: list[int], shard: TokenShard, device: torch.device
) -> torch.Tensor | BlockMask | LengthGroups | SequencePieces:
    """What `PackedAttention` takes on `device` (see the module docstring): the sequences'
    length groups or pieces, or a BlockMask on CUDA, a dense mask elsewhere.
    `lengths`: the sequences' lengths, read from `cu_seqlens` to the host once by the
    caller."""
    if torch.device(device).type != "cuda":
        return packed_causal_mask(cu_seqlens, shard, device)
    if shard.size > 1 and len(lengths) <= SPAN_LIMIT:
        # The bound of spans on the row's sequences: n sequences make at most n + 1 pieces
        # on a rank (one per chunk, and one more per sequence starting inside a chunk), at
        # most two cuDNN launches each, where spans take n launches.
        return SequencePieces.of(cu_seqlens, lengths, shard, device)
    if shard.size == 1:
        _check_row_tokens(sum(lengths), shard)
        return LengthGroups.of(lengths, device)
    return packed_block_mask(cu_seqlens, shard, device)


@dataclass(frozen=True)
class SequencePieces:
    """A context-parallel rank's queries cut where a sequence meets one of its two chunks:
    piece (qa, qb, ka, kb) holds local queries [qa, qb), which see the row's keys [ka, kb)
    (their sequence's start up to the piece's end; `merged_attention`). `key_order` [T]:
    each row position's index among the gathered keys (`TokenShard.key_positions`), which
    puts them in row order; `width`: the gather's per-rank width. `cu_seqlens` and `shard`
    build FlexAttention's mask for the dtypes cuDNN does not take (`block_mask`)."""

    pieces: tuple[Piece, ...]
    key_order: torch.Tensor
    width: int
    cu_seqlens: torch.Tensor
    shard: TokenShard

    @classmethod
    def of(
        cls, cu_seqlens: torch.Tensor, lengths: list[int], shard: TokenShard, device: Any
    ) -> SequencePieces:
        _check_row_tokens(sum(lengths), shard)
        sequences = _sequence_spans(lengths)
        pieces, local = [], 0
        # The rank's tokens are its early chunk, then its late one (`TokenShard.index`).
        for c0, c1 in shard.spans:
            for start, end in sequences:
                a, b = max(c0, start), min(c1, end)
                if a < b:
                    pieces.append(Piece(local + a - c0, local + b - c0, start, b))
            local += c1 - c0
        order = to_device(shard.key_order(), device)
        return cls(tuple(pieces), order, shard.width, cu_seqlens, shard)

    @cached_property
    def block_mask(self) -> BlockMask:
        """FlexAttention's mask of the same attention (built on first use)."""
        return packed_block_mask(self.cu_seqlens, self.shard, self.key_order.device)


@dataclass(frozen=True)
class PackedRows:
    """A packed micro batch as each layer's core attention needs it: `mask` from
    `packed_attention_mask`, and the cosines and sines of the local tokens' rotary angles
    ([T_local, 1, 1, d] float32, Megatron's table indexed by position id; computed once per
    micro batch, not per layer). Passed as the layer's attention mask, with no rotary table,
    so that Megatron's unfused RoPE does not run. `cu_seqlens`: the row's sequence
    boundaries on the host, for token mixers that run along each sequence (Gated DeltaNet
    layers: their kernels plan from host boundaries without a device read)."""

    mask: torch.Tensor | BlockMask | LengthGroups | SequencePieces
    cos: torch.Tensor
    sin: torch.Tensor
    cu_seqlens: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        mask: torch.Tensor | BlockMask | LengthGroups | SequencePieces,
        angles: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> PackedRows:
        return cls(mask, angles.cos(), angles.sin(), cu_seqlens)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout (Megatron's and HF's): x cos + rotate_half(x) sin, with
    cos and sin cast to x's dtype, the same ops as Megatron's unfused path. x [T, 1, heads,
    d], cos and sin [T, 1, 1, d]."""
    x1, x2 = x.chunk(2, -1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), -1) * sin.to(x.dtype)


def _rotate_qk(query, key, cos, sin):
    width = cos.shape[-1]
    if width < query.shape[-1]:  # RoPE on the first `width` channels (GLM-4.5), the rest as is
        q, k = _rotate_qk(query[..., :width], key[..., :width], cos, sin)
        return torch.cat([q, query[..., width:]], -1), torch.cat([k, key[..., width:]], -1)
    if query.is_cuda:
        from mtprun.kernels.rope import rotate_qk  # Triton: imported where a GPU runs it

        return rotate_qk(query, key, cos, sin)
    return rotate(query, cos, sin), rotate(key, cos, sin)


@cache
def _compiled_flex_attention():
    # Packed micro batches differ in length: one dynamic-shape kernel serves them all.
    return torch.compile(flex_attention, dynamic=True)


class PackedAttention(DotProductAttention):
    """Megatron-core's core attention over a packed row, with the keys and values of every
    rank of the context-parallel group.

    Inputs (Megatron's layout): query [T_local, 1, heads, d], key and value [T_local, 1,
    groups, d] for this rank's tensor-parallel heads; `attention_mask` a `PackedRows` (q and
    k not yet rotated), or a mask alone under Megatron's own forward. Output [T_local, 1,
    heads * d]. Under context parallelism the rotated keys and the values of the cp ranks
    are all-gathered (one collective per layer; the backward sums their gradients, see
    `gather_keys`).
    """

    def forward(self, query, key, value, attention_mask, *args: Any, **kwargs: Any):
        mask = attention_mask
        if isinstance(attention_mask, PackedRows):
            query, key = _rotate_qk(query, key, attention_mask.cos, attention_mask.sin)
            mask = attention_mask.mask
        # else: Megatron's own GPTModel.forward, which rotated q and k itself
        if isinstance(mask, LengthGroups):
            return grouped_attention(query, key, value, mask)
        cp = parallel_state.get_context_parallel_world_size()
        if isinstance(mask, SequencePieces):
            group = parallel_state.get_context_parallel_group()
            if block_kernel(query.device, query.dtype) is None:
                key, value = gather_keys(key, value, mask.width, group)
                return _flex(query, key, value, mask.block_mask)
            key, value = gather_keys(key, value, mask.width, group, mask.key_order)
            return _merged_pieces(query, key, value, mask)
        if cp > 1:
            group = parallel_state.get_context_parallel_group()
            key, value = gather_keys(key, value, _key_length(mask) // cp, group)
        if isinstance(mask, BlockMask):
            return _flex(query, key, value, mask)
        return super().forward(query, key, value, mask, *args, **kwargs)


def _key_length(mask: torch.Tensor | BlockMask) -> int:
    return mask.seq_lengths[1] if isinstance(mask, BlockMask) else mask.shape[-1]


def _flex(query, key, value, mask: BlockMask) -> torch.Tensor:
    """[T, 1, heads, d] query, [S, 1, groups, d] keys/values -> [T, 1, heads * d]."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    # Compiled where it runs for real; on the CPU (tests) the eager reference computes it.
    attend = _compiled_flex_attention() if q.is_cuda else flex_attention
    out = attend(q, k, v, block_mask=mask, enable_gqa=True)
    return out.permute(2, 0, 1, 3).flatten(2)


def _merged_pieces(query, key, value, pieces: SequencePieces) -> torch.Tensor:
    """[T_local, 1, heads, d] query, [T, 1, groups, d] keys/values of the whole row in row
    order (`gather_keys` by `pieces.key_order`) -> [T_local, 1, heads * d]: each piece's
    blocks (`merged_attention`)."""
    out = merged_attention(query.squeeze(1), key.squeeze(1), value.squeeze(1), pieces.pieces)
    return out.flatten(1).unsqueeze(1)
