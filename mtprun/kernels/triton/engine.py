"""The chunked GPU head loss: cuBLAS GEMMs per chunk around the per-row Triton kernel.

For each chunk of policy rows (masked rows already dropped):
  1. logits = h_chunk @ W^T into a reused buffer (bf16 out, float32 accumulation);
     the MTP draft rows taught by this chunk's rows get their own logits the same way;
  2. `head_rows_kernel` turns each logits row into its statistics, values and dz, in place;
     draft rows run first, since they read their teacher rows before the policy kernel
     overwrites them;
  3. grad_h_chunk = dz @ W and grad_W += dz^T @ h_chunk.
Gradients are complete after the forward (as in Liger's fused linear cross-entropy), so the
backward only scales them by the incoming gradient. Extra memory is the chunk buffers,
sized by `chunk_bytes`, whatever N is.

A sequence-level ratio (GSPO) needs the log-probs of every row of a sequence before any
row's dz: a statistics pass over all chunks comes first (logits GEMM and the kernel's STATS
mode, exchanged under TP), then GSPO's per-sequence reduction over [R] vectors, then the loop
above with the kernel in GRAD mode. With one chunk its logits are still in the buffer and
the policy GEMM is not repeated; with several, each chunk's logits are computed twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtprun.kernels.accumulate import addmm_into
from mtprun.kernels.combine import needs_sequence_ratio
from mtprun.kernels.triton import rows as k
from mtprun.kernels.triton.groups import KernelGroup
from mtprun.kernels.triton.launch import run_rows
from mtprun.kernels.triton.tensor_parallel import all_reduce_

DEFAULT_CHUNK_BYTES = 768 << 20
_ROW_MULTIPLE = 256  # cuBLAS picks its fastest kernels for such heights (bench --sweeps)


@dataclass
class Grads:
    """Gradients of the loss w.r.t. the compacted student rows of each group, and W."""

    students: list[torch.Tensor | None]
    weight: torch.Tensor | None


def chunk_rows(
    num_rows: int, vocab_local: int, itemsize: int, buffers: int, chunk_bytes: int
) -> int:
    """Rows per chunk: `buffers` logits buffers fit in `chunk_bytes`, and the chunks are
    about equal (a small last chunk runs its GEMMs at a poor rate)."""
    most = chunk_bytes // (vocab_local * itemsize * buffers)
    if most < _ROW_MULTIPLE:
        return max(min(most, num_rows), 1)
    most = most // _ROW_MULTIPLE * _ROW_MULTIPLE
    chunks = -(-num_rows // most)
    balanced = -(-num_rows // max(chunks, 1))
    return max(1, min(num_rows, most, -(-balanced // _ROW_MULTIPLE) * _ROW_MULTIPLE))


@dataclass
class _Chunk:
    """Policy rows [start, stop) and, per draft group, its rows taught by them."""

    start: int
    stop: int
    drafts: list[tuple[int, int]]
    buffers: list[torch.Tensor]


def run_chunks(
    policy: KernelGroup,
    drafts: list[KernelGroup],
    weight: torch.Tensor,
    *,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    teacher_positions: list[torch.Tensor],
    vocab_offset: int,
    need_grads: list[bool],
    need_weight_grad: bool,
    chunk_bytes: int,
    tp_group: dist.ProcessGroup | None,
    weight_main_grad: torch.Tensor | None = None,
    weight_grad_scale: float = 1.0,
) -> Grads:
    """Values, statistics (written into the groups) and gradients of every group.

    teacher_positions[i]: for draft group i, the position of each row's teacher among the
    policy rows (sorted ascending, as draft rows are). With `weight_main_grad` (float32, W's
    shape) W's gradient times `weight_grad_scale` is added into it GEMM by GEMM and
    Grads.weight stays None.
    """
    vocab_local = weight.shape[0]
    groups = [policy, *drafts]
    n_buffers = len(groups) + (teacher_hidden is not None)
    rows = chunk_rows(policy.num_rows, vocab_local, weight.element_size(), n_buffers, chunk_bytes)
    buffers = [weight.new_empty(rows, vocab_local) for _ in groups]
    if teacher_weight is not None:  # the teacher may run in another dtype
        buffers.append(teacher_weight.new_empty(rows, vocab_local))
    bounds = [*range(0, policy.num_rows, rows), policy.num_rows]
    draft_bounds = [
        torch.searchsorted(pos, torch.tensor(bounds, device=pos.device)).tolist()
        for pos in teacher_positions
    ]
    grads = Grads(
        students=[
            torch.empty_like(g.student) if need else None
            for g, need in zip(groups, need_grads, strict=True)
        ],
        weight=None,
    )

    def policy_logits(c: _Chunk) -> None:
        torch.mm(policy.student[c.start : c.stop], weight.t(), out=c.buffers[0])
        if teacher_hidden is not None:
            torch.mm(teacher_hidden[c.start : c.stop], teacher_weight.t(), out=c.buffers[-1])

    def logits_phase(c: _Chunk, policy_too: bool) -> None:
        if policy_too:
            policy_logits(c)
        for d, (start, stop) in enumerate(c.drafts):
            torch.mm(drafts[d].student[start:stop], weight.t(), out=c.buffers[1 + d])

    def policy_rows(c: _Chunk, phase: str) -> None:
        teacher = c.buffers[-1] if teacher_hidden is not None else None
        run_rows(
            c.buffers[0],
            policy,
            c.start,
            c.stop,
            vocab_offset=vocab_offset,
            teacher=teacher,
            teacher_rows=None if teacher is None else _arange_like(teacher),
            tp_group=tp_group,
            phase=phase,
        )

    def rows_phase(c: _Chunk, phase: str) -> None:
        # Draft rows first: they read their teacher rows before the policy kernel
        # overwrites them with dz.
        for d, (start, stop) in enumerate(c.drafts):
            teacher_rows = teacher_positions[d][start:stop] - c.start
            _run_draft(
                drafts[d],
                c.buffers[1 + d],
                c.buffers[0],
                teacher_rows,
                start,
                stop,
                vocab_offset,
                tp_group,
            )
        policy_rows(c, phase)

    def grads_phase(c: _Chunk) -> None:
        spans = [(c.start, c.stop), *c.drafts]
        for index, (group, (start, stop)) in enumerate(zip(groups, spans, strict=True)):
            dz = c.buffers[index]
            if grads.students[index] is not None:
                torch.mm(dz, weight, out=grads.students[index][start:stop])
            if need_weight_grad and group.group.trains_weight and stop > start:
                student = group.student[start:stop]
                if weight_main_grad is not None:
                    addmm_into(weight_main_grad, dz.t(), student, alpha=weight_grad_scale)
                elif grads.weight is None:
                    grads.weight = torch.mm(dz.t(), student)
                else:
                    grads.weight.addmm_(dz.t(), student)

    def chunk(i: int) -> _Chunk:
        start, stop = bounds[i], bounds[i + 1]
        spans = [(b[i], b[i + 1]) for b in draft_bounds]
        sizes = [stop - start, *(b - a for a, b in spans)]
        if teacher_hidden is not None:
            sizes.append(stop - start)
        return _Chunk(start, stop, spans, [b[:n] for b, n in zip(buffers, sizes, strict=True)])

    num_chunks = len(bounds) - 1
    sequence_ratio = needs_sequence_ratio(policy.group)
    if sequence_ratio:
        for i in range(num_chunks):
            c = chunk(i)
            policy_logits(c)
            policy_rows(c, "stats")
        policy.set_sequence_ratio()
    for i in range(num_chunks):
        c = chunk(i)
        logits_phase(c, policy_too=not sequence_ratio or num_chunks > 1)
        rows_phase(c, "grad" if sequence_ratio else "all")
        grads_phase(c)

    if need_weight_grad and grads.weight is None and weight_main_grad is None:
        grads.weight = torch.zeros_like(weight)
    if tp_group is not None:
        for grad in grads.students:
            all_reduce_(grad, tp_group)
    return grads


def _run_draft(
    draft: KernelGroup,
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    teacher_rows: torch.Tensor,
    start: int,
    stop: int,
    vocab_offset: int,
    tp_group: dist.ProcessGroup | None,
) -> None:
    if stop == start:
        return
    topk = draft.topk
    if topk:
        # The teacher's top-k over the whole vocabulary, renormalised; dz = w (s - q_topk).
        top_values, top_ids = teacher_logits.topk(topk, dim=1)
        top_values, top_ids = top_values[teacher_rows], top_ids[teacher_rows]
        q = top_values.float().softmax(-1)
        student_at_top = logits.gather(1, top_ids).float()
    run_rows(
        logits,
        draft,
        start,
        stop,
        vocab_offset=vocab_offset,
        teacher=teacher_logits,
        teacher_rows=teacher_rows,
        tp_group=tp_group,
    )
    if topk:
        (call,) = draft.calls  # the top-k target's row: w p in the kernel, -w q_topk here
        values = draft.values[start:stop]
        lse = values[:, k.VALUE_COLUMNS.index("lse")]
        values[:, k.VALUE_COLUMNS.index(call.row.per_token)] = lse - (q * student_at_top).sum(-1)
        w = draft.weights[start:stop, k.WEIGHT_COLUMNS.index(call.row.name), None]
        logits.scatter_add_(1, top_ids, (-w * q).to(logits.dtype))


def _arange_like(rows: torch.Tensor) -> torch.Tensor:
    return torch.arange(rows.shape[0], device=rows.device)
