"""Qwen3.5's Gated DeltaNet token mixer as a Megatron-core self-attention module over packed
rows, and its zero-centred RMSNorm.

Written here rather than subclassing megatron-core 0.16's `ssm/gated_delta_net.py`
`GatedDeltaNet`: that module refuses packed sequences (`packed_seq_params` raises), needs
flash-linear-attention at construction even on CPU, and fuses q, k, v, z, b, a into one
`in_proj` whose tensor-parallel layout is its own. This one keeps the HF projections apart
(megatron's Column/RowParallelLinear, split by key head with its value heads, see
`mtprun.models.families.qwen3_5.convert`) and calls mtprun's kernels
(`mtprun.kernels.gated_delta`: fla's Triton kernels on CUDA, a chunked torch path elsewhere),
whose conv window and delta-rule state restart at every sequence start of the packed row
(`PackedRows.cu_seqlens`).

Per token t, on this rank's Hk key heads and Hv = r Hk value heads (r value heads per key head):

    [q, k, v] = silu(causal_conv1d(in_proj_qkv(x)))      q, k: [Hk, Dk]; v: [Hv, Dv]
    q, k      = l2norm(q), l2norm(k), key head h // r serving value head h (in the kernel)
    beta      = sigmoid(in_proj_b(x));   g = -exp(A_log) softplus(in_proj_a(x) + dt_bias)
    o         = gated_delta_rule(q, k, v, g, beta)       [Hv, Dv], scale Dk^-1/2
    y         = out_proj(rmsnorm(o) w * silu(in_proj_z(x)))   (rmsnorm per value head)

Under context parallelism (`mtprun.runner.trainer.context_parallel`: rank r holds row chunks r
and 2cp-1-r of the 2cp near-equal chunks) a rank's tokens are two slices of the row, and the conv
window and the delta-rule state run on from the chunk before across ranks
(`ContextParallelPlan`): two all_gathers per layer (the conv input's last W-1 rows of every
chunk, every chunk's final state; their backward sums the gradients back over the group), and
the one-process row's outputs and gradients up to float rounding.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from mtprun.kernels.fused_norms import gated_rms_norm, l2_normalize, zero_centered_rms_norm
from mtprun.kernels.gated_delta import causal_conv1d, gated_delta_rule, gated_delta_rule_states
from mtprun.models.qwen3_5_shape import LinearAttentionShape
from mtprun.runner.trainer.context_parallel import TokenShard, gather_rows

L2NORM_EPS = 1e-6  # transformers' and fla's l2norm epsilon


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight w is stored centred on zero: y = x / rms(x) * (1 + w), computed in
    float32 and returned in x's dtype (transformers' Qwen3_5RMSNorm). Built by Megatron's layer
    specs (`config`, `hidden_size`, `eps`) as input, pre-MLP, q/k and final norm."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(torch.nn.Module):
    """The GDN output norm, per value head: rmsnorm(o) w * silu(z) (w not zero-centred; the
    norm in float32, cast back to o's dtype before the weight, as transformers does)."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=dtype))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, z, self.weight, self.eps)


class PackedGatedDeltaNet(MegatronModule):
    """A Gated DeltaNet layer's token mixer in Megatron's self-attention slot: [T, 1, H] in,
    ([T, 1, H], None) out; `attention_mask` is the micro batch's `PackedRows`."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        linear: LinearAttentionShape,
        pg_collection: ProcessGroupCollection | None = None,
        **_: Any,
    ) -> None:
        super().__init__(config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_group = pg_collection.tp
        tp = tp_group.size()
        self.layer_number = layer_number
        self.key_heads = linear.key_heads // tp
        self.value_heads = linear.value_heads // tp
        self.key_dim, self.value_dim = linear.key_dim, linear.value_dim
        self.heads_per_key = linear.heads_per_key

        def column(width: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                config.hidden_size,
                width,
                config=config,
                init_method=config.init_method,
                bias=False,
                gather_output=False,
                tp_group=tp_group,
            )

        self.in_proj_qkv = column(linear.conv_channels)
        self.in_proj_z = column(linear.value_heads * linear.value_dim)
        self.in_proj_b = column(linear.value_heads)
        self.in_proj_a = column(linear.value_heads)
        dtype = config.params_dtype
        self.conv_weight = torch.nn.Parameter(
            torch.empty(linear.conv_channels // tp, linear.conv_kernel, dtype=dtype)
        )
        self.A_log = torch.nn.Parameter(torch.zeros(self.value_heads, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads, dtype=dtype))
        self.out_norm = GatedRMSNorm(linear.value_dim, config.layernorm_epsilon, dtype)
        self.out_proj = RowParallelLinear(
            linear.value_heads * linear.value_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=tp_group,
        )

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: Any, **_: Any
    ) -> tuple[torch.Tensor, None]:
        cu_seqlens = getattr(attention_mask, "cu_seqlens", None)
        if cu_seqlens is None:
            raise ValueError(
                "a Gated DeltaNet layer needs the packed row's cu_seqlens (PackedRows); "
                "Megatron's own GPTModel.forward does not pass them"
            )
        tokens = hidden_states.shape[0]
        qkv, _ = self.in_proj_qkv(hidden_states)
        z, _ = self.in_proj_z(hidden_states)
        b, _ = self.in_proj_b(hidden_states)
        a, _ = self.in_proj_a(hidden_states)
        # The conv weight in the projections' dtype, as autocast gives the linear layers theirs.
        weight = self.conv_weight.to(qkv.dtype)
        plan = context_parallel_plan(cu_seqlens, tokens, weight.shape[-1])
        if plan is None:
            qkv = causal_conv1d(qkv[:, 0], weight, None, cu_seqlens, "silu")
        else:
            group = parallel_state.get_context_parallel_group()
            tails = plan.conv_tails(qkv[:, 0])
            if tails.numel():  # a conv window of one reads no earlier rows
                tails = gather_rows(tails, len(tails), group)
            qkv = plan.conv(qkv[:, 0], weight, tails)
        per_key = self.heads_per_key * self.value_dim
        q, k, v = qkv.view(tokens, self.key_heads, -1).split(
            [self.key_dim, self.key_dim, per_key], -1
        )
        # Normalised in float32, then in v's dtype as fla's kernels take them; each key head
        # serves its group of value heads inside the kernel (no repeated copy).
        q = l2_normalize(q, L2NORM_EPS)
        k = l2_normalize(k, L2NORM_EPS)
        v = v.reshape(tokens, self.value_heads, self.value_dim)
        beta = b[:, 0].sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a[:, 0].float() + self.dt_bias.float())
        if plan is None:
            o = gated_delta_rule(q, k, v, g, beta, cu_seqlens)
        else:
            out, ends = plan.delta_rule_local(q, k, v, g, beta)
            o = plan.delta_rule_finish(out, gather_rows(ends, len(ends), group))
        o = self.out_norm(o, z.view(tokens, self.value_heads, self.value_dim))
        out, _ = self.out_proj(o.reshape(tokens, 1, -1))
        return out, None


def context_parallel_plan(
    cu_seqlens: torch.Tensor, tokens: int, conv_width: int
) -> ContextParallelPlan | None:
    """This rank's `ContextParallelPlan` for the row that `cu_seqlens` (host) describes, of
    which it holds `tokens`; None without context parallelism. The last plan is kept: every
    layer of a micro batch gets the same boundaries tensor."""
    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return None
    shard = TokenShard(parallel_state.get_context_parallel_rank(), size, int(cu_seqlens[-1]))
    if len(shard.index) != tokens:
        raise ValueError(
            f"a Gated DeltaNet layer got {tokens} tokens, but context-parallel rank {shard.rank} "
            f"of {size} holds {len(shard.index)} of the {shard.num_tokens}-token row"
        )
    key = (shard, conv_width)
    if _last_plan[0] is not cu_seqlens or _last_plan[1] != key:
        _last_plan[:] = [cu_seqlens, key, ContextParallelPlan.of(cu_seqlens, shard, conv_width)]
    return _last_plan[2]


_last_plan: list = [None, None, None]  # [boundaries tensor, (shard, conv width), its plan]


@dataclass(frozen=True)
class ContextParallelPlan:
    """How a Gated DeltaNet layer runs on context-parallel rank `shard.rank`'s tokens: the
    rank holds row chunks c0 = rank and c1 = 2cp-1-rank (`TokenShard.chunk_spans`), laid out
    one after the other as its local row. The row's sequence starts cut each local chunk into
    pieces; a chunk's first piece continues a sequence from chunk c-1 unless a sequence starts
    at the chunk's first token.

    Conv (window W): each chunk's first W-1 outputs read the W-1 rows before it, which lie in
    the last W-1 rows of the chunks before it (a chunk may be shorter than W-1). Every rank
    all-gathers the last W-1 conv inputs of both its chunks; each local chunk runs behind its
    halo, zero where it would reach back past the sequence's start (as the one-process conv
    reads zeros there).

    Delta rule: the state after a stretch of one sequence is affine in the state before it,
    S_out = P S_in + Z, P = prod_t a_t (I - beta_t k_t k_t^T) [Dk, Dk], Z the state reached
    from zero. The local pieces run in one kernel call with v widened by Dk zero columns and
    initial state [0 | I] on continued pieces (zero elsewhere): the state columns then carry
    [Z_t | P_t], the outputs [o_t from S_in = 0 | scale P_t^T q_t], and the final state of each
    chunk's last piece is [Z | P] (P exactly 0 when that piece starts inside the chunk). One
    all_gather of both chunks' final states per rank; every rank folds them in row order,
    S_in(c+1) = Z_c + P_c S_in(c), S_in(0) = 0, and adds S_in(c)^T (scale P_t^T q_t) to its
    continued pieces' outputs. Costs the kernel (Dv + Dk) / Dv of its value-side work and two
    collectives of [W-1 rows] and [2, H, Dk, Dv + Dk] per rank; no recomputation.

    Every rank's output depends on both gathered tensors whatever the row's layout (the halo
    is indexed out of the gathered tails, zero rows included; the fold always starts from
    chunk 0), so every rank reaches their backward collectives, in the same order.
    """

    halo: int  # W - 1
    local_cu_seqlens: torch.Tensor  # [pieces + 1] int64 host: the local row cut at every start
    pieces: int
    continued: tuple[int, ...]  # the pieces that continue a sequence from the chunk before
    last_pieces: tuple[int, int]  # each local chunk's last piece
    slots: tuple[tuple[int, int, int], ...]  # per local chunk (lo, end of first piece, hi)
    own_chunks: tuple[int, int]  # c0, c1
    chunk_sources: tuple[int, ...]  # per row chunk: its row of the gathered final states
    tail_index: torch.Tensor  # [2 (W-1)] local rows sent as tails (tokens: a zero row)
    halo_index: torch.Tensor  # [2 (W-1)] rows of the gathered tails (their count: zero row)
    conv_cu_seqlens: torch.Tensor  # host: [halo 0, chunk c0, halo 1, chunk c1] cut at starts
    conv_keep: torch.Tensor  # [T_local] rows of that layout that are local tokens
    # The index tensors above by device, copied once per micro batch rather than per layer.
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls, cu_seqlens: torch.Tensor, shard: TokenShard, conv_width: int
    ) -> ContextParallelPlan:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        total, size, halo = bounds[-1], shard.size, conv_width - 1
        starts = {b for b in bounds[:-1] if b < total}
        spans = shard.chunk_spans()
        chunk_starts = [a for a, _ in spans]

        def source(chunk: int) -> int:  # rank * 2 + (0: its first chunk, 1: its second)
            return 2 * chunk if chunk < size else 2 * (2 * size - 1 - chunk) + 1

        own = (shard.rank, 2 * size - 1 - shard.rank)
        local_tokens = sum(b - a for a, b in (spans[c] for c in own))
        local_bounds, continued, last_pieces, slots = [0], [], [], []
        tail_index, halo_index, conv_bounds = [], [], [0]
        lo = 0
        for slot, chunk in enumerate(own):
            start, end = spans[chunk]
            inner = sorted(b for b in starts if start < b < end)
            hi = lo + end - start
            local_bounds += [lo + b - start for b in (*inner, end)]
            continued += [start not in starts] + [False] * len(inner)
            last_pieces.append(len(continued) - 1)
            slots.append((lo, lo + (inner[0] if inner else end) - start, hi))
            # Conv layout: local token i of this chunk sits at i + (slot + 1) (W - 1).
            if slot == 1:
                conv_bounds.append(lo + halo)  # the halo joins this chunk's first piece
            conv_bounds += [lo + b - start + (slot + 1) * halo for b in inner]
            for i in range(halo):
                tail = end - halo + i
                tail_index.append(lo + tail - start if tail >= start else local_tokens)
            sequence_start = bounds[bisect.bisect_right(bounds, start) - 1]
            for i in range(halo):
                before = start - halo + i
                if before < sequence_start:
                    halo_index.append(2 * size * halo)
                    continue
                holder = bisect.bisect_right(chunk_starts, before) - 1
                halo_index.append(source(holder) * halo + before - (spans[holder][1] - halo))
            lo = hi
        conv_bounds.append(local_tokens + 2 * halo)
        first = slots[0][2]
        keep = torch.cat(
            [
                torch.arange(halo, halo + first),
                torch.arange(first + 2 * halo, local_tokens + 2 * halo),
            ]
        )
        return cls(
            halo=halo,
            local_cu_seqlens=torch.tensor(local_bounds, dtype=torch.long),
            pieces=len(continued),
            continued=tuple(i for i, c in enumerate(continued) if c),
            last_pieces=(last_pieces[0], last_pieces[1]),
            slots=tuple(slots),
            own_chunks=own,
            chunk_sources=tuple(source(c) for c in range(2 * size)),
            tail_index=torch.tensor(tail_index, dtype=torch.long),
            halo_index=torch.tensor(halo_index, dtype=torch.long),
            conv_cu_seqlens=torch.tensor(conv_bounds, dtype=torch.long),
            conv_keep=keep,
        )

    def _index(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device)
        if key not in self._on_device:
            self._on_device[key] = getattr(self, name).to(device)
        return self._on_device[key]

    def conv_tails(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of x [T_local, C] that later chunks' conv windows read: the last W-1 of each
        local chunk, zero-padded in front for a chunk shorter than that: [2 (W-1), C]."""
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        return padded.index_select(0, self._index("tail_index", x.device))

    def conv(self, x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
        """silu(causal_conv1d) of the local rows x [T_local, C] (weight [C, W]) as the whole
        row's conv gives them, from every rank's `conv_tails` gathered ([cp * 2 (W-1), C],
        rank by rank)."""
        if self.halo == 0:
            return causal_conv1d(x, weight, None, self.local_cu_seqlens, "silu")
        zero = x.new_zeros(1, x.shape[1])
        halos = torch.cat([tails, zero]).index_select(0, self._index("halo_index", x.device))
        first = self.slots[0][2]
        laid_out = torch.cat([halos[: self.halo], x[:first], halos[self.halo :], x[first:]])
        y = causal_conv1d(laid_out, weight, None, self.conv_cu_seqlens, "silu")
        return y.index_select(0, self._index("conv_keep", x.device))

    def delta_rule_local(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The local pieces from S_in = [0 | I] where they continue a sequence (q, k [T_local,
        Hk, Dk], v [T_local, H, Dv], g, beta [T_local, H]): the outputs [T_local, H, Dv + Dk]
        ([o from S_in = 0 | scale P_t^T q_t]) and the local chunks' final states [Z | P],
        [2, H, Dk, Dv + Dk] in the state dtype (float32; float64 for float64 inputs on the
        CPU), to be gathered for `delta_rule_finish`."""
        tokens, heads, dv = v.shape
        dk = q.shape[-1]
        wide = torch.cat([v, v.new_zeros(tokens, heads, dk)], -1)
        dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
        initial = q.new_zeros(self.pieces, heads, dk, dv + dk, dtype=dtype)
        identity = torch.eye(dk, dtype=dtype, device=q.device)
        for piece in self.continued:
            initial[piece, :, :, dv:] = identity
        out, final = gated_delta_rule_states(q, k, wide, g, beta, self.local_cu_seqlens, initial)
        return out, torch.stack([final[piece] for piece in self.last_pieces])

    def delta_rule_finish(self, out: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """`gated_delta_rule` of the local rows as the whole row's gives them, [T_local, H, Dv]
        in out's dtype, from `delta_rule_local`'s outputs and every rank's final states
        gathered ([2 cp, H, Dk, Dv + Dk], rank by rank)."""
        heads, dk = ends.shape[1], ends.shape[2]
        dv = ends.shape[3] - dk
        # S_in of every row chunk up to this rank's last, folded in row order (the same on
        # every rank; P is exactly 0 where a sequence starts inside a chunk, so no branches).
        entering = [ends.new_zeros(heads, dk, dv)]
        for source in self.chunk_sources[: max(self.own_chunks)]:
            end = ends[source]
            entering.append(end[..., :dv] + end[..., dv:] @ entering[-1])
        pieces = []
        for (lo, first_end, hi), chunk in zip(self.slots, self.own_chunks, strict=True):
            carried = torch.einsum(
                "thk,hkv->thv", out[lo:first_end, :, dv:].to(ends.dtype), entering[chunk]
            )
            pieces += [out[lo:first_end, :, :dv] + carried.to(out.dtype), out[first_end:hi, :, :dv]]
        return torch.cat(pieces)
