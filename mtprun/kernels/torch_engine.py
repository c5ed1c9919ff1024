"""The fused head loss in plain torch: rows in chunks, the vocab in tiles, float32 work.

Two schedules, picked per row group from the memory budget (`Chunking`):

- one pass: the whole local vocab fits as one tile for a chunk of rows. Each chunk's logits
  are computed once; statistics, loss and d loss / d logits come from that one tile, and the
  gradients w.r.t. the hidden rows and the weight are accumulated right away (3 GEMMs in all,
  like plain torch, no recompute). Backward only scales them by grad_output.
- two passes (smaller tiles, or tensor parallelism where the statistics need the other
  ranks' shards first, or a sequence-level ratio (GSPO) whose coefficients need the log-probs
  of every row of a sequence, when the group's rows span several chunks): a statistics pass
  over all tiles in forward, then in backward a gradient pass that recomputes each logits
  tile (4 GEMMs in all).

Either way extra memory is O(rows_per_chunk x tile) plus the float32 gradient accumulators.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtprun.compiler import HeadPlan
from mtprun.kernels import tensor_parallel
from mtprun.kernels.combine import (
    GroupWeights,
    add_metrics,
    combine,
    needs_sequence_ratio,
    row_inputs,
    with_sequence_ratio,
)
from mtprun.kernels.inputs import HeadInputs
from mtprun.kernels.online_stats import PartialStats, StatsSpec, finalize, merge, tile_stats
from mtprun.kernels.row_groups import RowGroup
from mtprun.losses import GradCoeffs, RowInputs, RowStats

_FLOAT32_BYTES = 4
# [rows x tile] float32 buffers alive at once: z - max, exp(z - max) and a temporary of the
# gradient; a dense teacher adds its logits and their exp.
_STUDENT_BUFFERS, _TEACHER_BUFFERS = 3, 2


@dataclass(frozen=True)
class Chunking:
    """How the torch engine splits rows and vocab.

    memory_budget:  bytes for the float32 [rows x tile] work buffers of one chunk.
    vocab_tile:     columns per tile; None picks the whole local vocab when a chunk of at
                    least `min_rows` rows fits the budget (one-pass schedule), else the
                    widest tile that does.
    rows_per_chunk: rows per chunk; None fills the budget.
    min_rows:       fewest rows per chunk the automatic layout accepts: every chunk streams
                    the whole weight through each GEMM, so short chunks are memory-bound.
                    Measured on a 2-core CPU (bench/RESULTS.md): 1365-row chunks over 4096-
                    column tiles (two passes, 4 GEMMs) beat 174-row chunks over the whole
                    vocab (one pass, 3 GEMMs) at the same budget.
    """

    memory_budget: int = 64 * 2**20
    vocab_tile: int | None = None
    rows_per_chunk: int | None = None
    min_rows: int = 1024

    def __post_init__(self) -> None:
        for name in ("memory_budget", "vocab_tile", "rows_per_chunk", "min_rows"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"Chunking.{name} must be a positive integer, got {value}")

    def layout(self, vocab: int, buffers: int) -> tuple[int, int]:
        """(rows_per_chunk, tile) for a local vocab of `vocab` columns and `buffers` work
        buffers of [rows x tile] float32 each."""
        per_cell = buffers * _FLOAT32_BYTES
        tile = self.vocab_tile
        if tile is None:
            fits_whole = self.memory_budget // (per_cell * vocab) >= self.min_rows
            tile = vocab if fits_whole else self.memory_budget // (per_cell * self.min_rows)
        tile = max(1, min(tile, vocab))
        rows = self.rows_per_chunk or max(1, self.memory_budget // (per_cell * tile))
        return rows, tile


@dataclass
class _GroupRun:
    """One row group's schedule and, after forward, its statistics and coefficients."""

    group: RowGroup
    spec: StatsSpec
    weights: GroupWeights
    inputs: RowInputs
    rows_per_chunk: int
    tile: int
    one_pass: bool
    stats: RowStats | None = None
    grad: GradCoeffs | None = None


@dataclass
class Gradients:
    """float32 accumulators; None where no gradient is wanted."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    mtp_hidden: list[torch.Tensor | None] = field(default_factory=list)


@dataclass
class ForwardResult:
    loss: torch.Tensor
    logprobs: torch.Tensor
    metrics: torch.Tensor  # [len(plan.metrics)] in plan order


class TorchHeadEngine:
    """Runs a HeadPlan on validated inputs; `forward` then (optionally) `backward`."""

    def __init__(
        self,
        plan: HeadPlan,
        inputs: HeadInputs,
        groups: list[RowGroup],
        chunking: Chunking,
        tp_group: dist.ProcessGroup | None,
    ) -> None:
        self.plan = plan
        self.inputs = inputs
        self.tp_group = tp_group
        local_vocab = inputs.weight.shape[0]
        self.runs = []
        for group in groups:
            spec = StatsSpec.of(group)
            buffers = _STUDENT_BUFFERS + (_TEACHER_BUFFERS if spec.teacher_dense else 0)
            rows, tile = chunking.layout(local_vocab, buffers)
            # A sequence-level ratio needs every row's log-prob before any coefficient.
            in_one_chunk = not needs_sequence_ratio(group) or rows >= group.num_rows
            self.runs.append(
                _GroupRun(
                    group=group,
                    spec=spec,
                    weights=GroupWeights.of(group, inputs),
                    inputs=row_inputs(group, inputs),
                    rows_per_chunk=rows,
                    tile=tile,
                    one_pass=tile == local_vocab and tp_group is None and in_one_chunk,
                )
            )
        self.grads: Gradients | None = None
        self.backward_done = False

    def forward(self, want: Gradients) -> ForwardResult:
        """Statistics, loss and metrics; with the one-pass schedule also the gradients the
        non-None fields of `want` ask for (accumulated into them)."""
        self.grads = want
        wants_any = (
            want.hidden is not None
            or want.weight is not None
            or any(g is not None for g in want.mtp_hidden)
        )
        loss = self.inputs.hidden.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        pending = []
        for run in self.runs:
            if run.one_pass and wants_any:
                part_loss, part_metrics = self._one_pass(run)
                loss = loss + part_loss
                add_metrics(metrics, part_metrics)
            else:
                pending.append((run, self._stats_pass(run)))
        if pending:
            exchanged = tensor_parallel.exchange_stats(
                [partial for _, partial in pending], [run.spec for run, _ in pending], self.tp_group
            )
            for (run, _), partial in zip(pending, exchanged, strict=True):
                run.stats = finalize(partial)
                run.inputs = self._with_sequence_ratio(run, run.stats, run.inputs)
                result = combine(run.group, run.stats, run.inputs, run.weights)
                run.grad = result.grad
                loss = loss + result.loss
                add_metrics(metrics, result.metrics)
        return ForwardResult(loss=loss, logprobs=self._logprobs(), metrics=self._ordered(metrics))

    def backward(self, grad_loss: torch.Tensor) -> Gradients:
        """Gradients of the loss scaled by grad_loss (two-pass groups run their gradient pass
        here); under tensor parallelism grad_hidden / grad_mtp_hidden are summed over ranks.
        Scales the accumulators in place, so one backward per forward."""
        grads = self.grads
        if self.backward_done:
            raise RuntimeError(
                "head_loss backward ran twice on one forward: call head_loss again instead of "
                "backward(retain_graph=True)"
            )
        for run in self.runs:
            if not run.one_pass:
                self._gradient_pass(run)
        hidden_grads = [g for g in (grads.hidden, *grads.mtp_hidden) if g is not None]
        tensor_parallel.all_reduce_grads(hidden_grads, self.tp_group)
        for tensor in (*hidden_grads, grads.weight):
            if tensor is not None:
                tensor.mul_(grad_loss)
        self.backward_done = True
        return grads

    def _one_pass(self, run: _GroupRun) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        group, chunks = run.group, []
        loss, metrics = self.inputs.hidden.new_zeros((), dtype=torch.float32), {}
        for rows in _chunks(group.num_rows, run.rows_per_chunk):
            student, teacher = self._chunk_hidden(group, rows)
            local_vocab = self.inputs.weight.shape[0]
            partial, buffers = self._tile(run, rows, student, teacher, 0, local_vocab)
            stats = finalize(partial)
            inputs = self._with_sequence_ratio(run, stats, run.inputs.select(rows))
            result = combine(group, stats, inputs, run.weights.select(rows))
            loss = loss + result.loss
            add_metrics(metrics, result.metrics)
            chunks.append(stats)
            shifted, expz, *t_exp = buffers
            probs = expz.div_(partial.sumexp[:, None])
            q = t_exp[0].div_(partial.t_sumexp[:, None]) if t_exp else None
            grad_rows = self._hidden_grad_rows(run, student)
            tile = (shifted, probs, q)
            self._accumulate(run, student, grad_rows, 0, tile, stats, result.grad, rows)
            self._store_hidden_grad(run, rows, grad_rows)
        run.stats = _cat_stats(chunks) if chunks else None
        return loss, metrics

    def _with_sequence_ratio(self, run: _GroupRun, stats: RowStats, inputs: RowInputs) -> RowInputs:
        """GSPO's per-sequence ratio, once `stats` hold every row of the group."""
        if not needs_sequence_ratio(run.group):
            return inputs
        num_sequences = self.inputs.cu_seqlens.shape[0] - 1
        return with_sequence_ratio(run.group, stats.logprob, inputs, num_sequences)

    def _stats_pass(self, run: _GroupRun) -> PartialStats:
        """Statistics of every row of the group over this rank's vocab (all tiles)."""
        local_vocab = self.inputs.weight.shape[0]
        per_chunk = []
        for rows in _chunks(run.group.num_rows, run.rows_per_chunk):
            student, teacher = self._chunk_hidden(run.group, rows)
            partial = None
            for start in range(0, local_vocab, run.tile):
                stop = min(start + run.tile, local_vocab)
                tile, _ = self._tile(run, rows, student, teacher, start, stop)
                partial = tile if partial is None else merge(partial, tile)
            per_chunk.append(partial)
        if not per_chunk:
            return PartialStats.empty(run.spec, self.inputs.hidden.device)
        return _cat_partials(per_chunk)

    def _gradient_pass(self, run: _GroupRun) -> None:
        if run.grad.a is None:
            return  # no term of this group trains anything (e.g. the policy of an MTP-only plan)
        local_vocab = self.inputs.weight.shape[0]
        group, stats = run.group, run.stats
        for rows in _chunks(group.num_rows, run.rows_per_chunk):
            chunk_stats, coeffs = stats.select(rows), run.grad.select(rows)
            student, teacher = self._chunk_hidden(group, rows)
            grad_rows = self._hidden_grad_rows(run, student)
            for start in range(0, local_vocab, run.tile):
                stop = min(start + run.tile, local_vocab)
                shifted = _logits(student, self.inputs.weight[start:stop])
                shifted.sub_(chunk_stats.max[:, None])
                probs = torch.exp(shifted - (chunk_stats.lse - chunk_stats.max)[:, None])
                q = None
                if run.spec.teacher_dense:
                    q = self._teacher_logits(group, teacher, start, stop)
                    q = q.sub_(chunk_stats.teacher_lse[:, None]).exp_()
                tile = (shifted, probs, q)
                self._accumulate(run, student, grad_rows, start, tile, chunk_stats, coeffs, rows)
            self._store_hidden_grad(run, rows, grad_rows)

    def _tile(
        self,
        run: _GroupRun,
        rows: slice,
        student: torch.Tensor,
        teacher: torch.Tensor | None,
        start: int,
        stop: int,
    ) -> tuple[PartialStats, tuple[torch.Tensor, ...]]:
        """Statistics of columns [start, stop) of the local vocab for one chunk of rows."""
        group = run.group
        z = _logits(student, self.inputs.weight[start:stop])
        t = self._teacher_logits(group, teacher, start, stop) if run.spec.teacher else None
        col_start = self.inputs.vocab_start + start
        return tile_stats(z, group.targets[rows], col_start, t, run.spec)

    def _chunk_hidden(
        self, group: RowGroup, rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 student (and teacher) hidden rows of one chunk."""
        student = group.student[group.rows[rows]].float()
        if group.teacher_rows is None:
            return student, None
        return student, group.teacher[group.teacher_rows[rows]].float()

    def _teacher_logits(
        self, group: RowGroup, teacher: torch.Tensor, start: int, stop: int
    ) -> torch.Tensor:
        logits = _logits(teacher, group.teacher_weight[start:stop])
        return (
            logits if group.teacher_temperature == 1.0 else logits.div_(group.teacher_temperature)
        )

    def _accumulate(
        self,
        run: _GroupRun,
        student: torch.Tensor,
        grad_rows: torch.Tensor | None,
        start: int,
        tile: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        stats: RowStats,
        coeffs: GradCoeffs,
        rows: slice,
    ) -> None:
        """d loss / d logits of one tile of a chunk, then its share of the chunk's hidden
        gradient (grad_rows) and of the weight gradient.

        tile: (z - max, p, q) of columns [start, start + width); the first is overwritten.
        """
        if coeffs.a is None:
            return
        shifted, probs, q = tile
        col_start = self.inputs.vocab_start + start
        dz = _dlogits(shifted, probs, q, coeffs, stats, run.group.targets[rows], col_start)
        stop = start + dz.shape[1]
        if grad_rows is not None:
            grad_rows.addmm_(dz, self.inputs.weight[start:stop].float())
        if self.grads.weight is not None and run.group.trains_weight:
            self.grads.weight[start:stop].addmm_(dz.T, student)

    def _hidden_grad_rows(self, run: _GroupRun, student: torch.Tensor) -> torch.Tensor | None:
        """A zeroed [C, H] buffer for the chunk's hidden gradient, or None if not wanted."""
        return None if self._hidden_grad(run.group) is None else torch.zeros_like(student)

    def _store_hidden_grad(
        self, run: _GroupRun, rows: slice, grad_rows: torch.Tensor | None
    ) -> None:
        # Rows are unique within a group and each lies in one chunk: a copy, not an add
        # (torch's CPU index_add_ is ~500x slower than index_copy_ here).
        if grad_rows is not None:
            self._hidden_grad(run.group).index_copy_(0, run.group.rows[rows], grad_rows)

    def _hidden_grad(self, group: RowGroup) -> torch.Tensor | None:
        return self.grads.hidden if group.head == 0 else self.grads.mtp_hidden[group.head - 1]

    def _logprobs(self) -> torch.Tensor:
        policy = self.runs[0]
        out = torch.zeros(self.inputs.num_rows, device=self.inputs.hidden.device)
        if policy.stats is not None:
            logprob = torch.where(policy.group.valid, policy.stats.logprob, 0.0)
            out[policy.group.rows] = logprob
        return out

    def _ordered(self, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        zero = torch.zeros((), device=self.inputs.hidden.device)
        return torch.stack([metrics.get(name, zero).float() for name in self.plan.metrics])


def _dlogits(
    shifted: torch.Tensor,
    probs: torch.Tensor,
    q: torch.Tensor | None,
    coeffs: GradCoeffs,
    stats: RowStats,
    targets: torch.Tensor,
    col_start: int,
) -> torch.Tensor:
    """a p + b e_y + c p (z - max) + d q for one tile, written into `shifted`'s storage."""
    a = coeffs.a.expand(probs.shape[0])[:, None]
    if coeffs.c is not None:
        dz = shifted.mul_(coeffs.c.expand(probs.shape[0])[:, None]).add_(a).mul_(probs)
    else:
        dz = torch.mul(probs, a, out=shifted)
    if coeffs.b is not None:
        _add_at_columns(dz, targets[:, None] - col_start, coeffs.b.expand(dz.shape[0])[:, None])
    if coeffs.d is not None and q is not None:
        dz.add_(q.mul_(coeffs.d[:, None]))
    elif coeffs.d is not None:  # top-k teacher: q is sparse on the teacher's top-k ids
        _add_at_columns(dz, stats.topk_ids - col_start, coeffs.d[:, None] * stats.topk_probs)
    return dz


def _add_at_columns(tile: torch.Tensor, columns: torch.Tensor, values: torch.Tensor) -> None:
    """tile[i, columns[i, j]] += values[i, j] where the column lies inside the tile.

    Goes through the flat storage: a 1-D index_add_ of a few values is cheap, while torch's
    CPU scatter_add_ / 2-D index_add_ paths cost tens of ms per call on wide tiles.
    """
    width = tile.shape[1]
    inside = (columns >= 0) & (columns < width)
    rows = torch.arange(tile.shape[0], device=tile.device)[:, None].expand_as(columns)
    flat = (rows * width + columns.clamp(0, width - 1))[inside]
    tile.view(-1).index_add_(0, flat, values[inside].to(tile.dtype))


def _logits(hidden_rows: torch.Tensor, weight_tile: torch.Tensor) -> torch.Tensor:
    """[C, T] float32 logits (bf16 operands are upcast: float32 accumulation and output)."""
    return hidden_rows @ weight_tile.float().T


def _chunks(num_rows: int, rows_per_chunk: int) -> list[slice]:
    return [slice(s, min(s + rows_per_chunk, num_rows)) for s in range(0, num_rows, rows_per_chunk)]


def _cat_partials(parts: list[PartialStats]) -> PartialStats:
    return PartialStats(
        **{
            name: None if value is None else torch.cat([getattr(p, name) for p in parts])
            for name, value in vars(parts[0]).items()
        }
    )


def _cat_stats(parts: list[RowStats]) -> RowStats:
    return RowStats(
        **{
            name: None if value is None else torch.cat([getattr(p, name) for p in parts])
            for name, value in vars(parts[0]).items()
        }
    )
