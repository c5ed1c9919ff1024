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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtprun.kernels.triton.groups import KernelGroup
from mtprun.kernels.triton.launch import run_rows
from mtprun.kernels.triton.tensor_parallel import all_reduce_

DEFAULT_CHUNK_BYTES = 768 << 20
_ROW_MULTIPLE = 128  # keeps the GEMM tiles full


@dataclass
class Grads:
    """Gradients of the loss w.r.t. the compacted student rows of each group, and W."""

    students: list[torch.Tensor | None]
    weight: torch.Tensor | None


def chunk_rows(vocab_local: int, itemsize: int, buffers: int, chunk_bytes: int) -> int:
    """Rows per chunk so that `buffers` logits buffers fit in `chunk_bytes`."""
    rows = chunk_bytes // (vocab_local * itemsize * buffers)
    if rows >= _ROW_MULTIPLE:
        return rows // _ROW_MULTIPLE * _ROW_MULTIPLE
    return max(rows, 1)


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
) -> Grads:
    """Values, statistics (written into the groups) and gradients of every group.

    teacher_positions[i]: for draft group i, the position of each row's teacher among the
    policy rows (sorted ascending, as draft rows are).
    """
    vocab_local = weight.shape[0]
    n_buffers = 1 + len(drafts) + (teacher_hidden is not None)
    chunk = chunk_rows(vocab_local, weight.element_size(), n_buffers, chunk_bytes)
    chunk = min(chunk, max(policy.num_rows, 1))
    buffers = [weight.new_empty(chunk, vocab_local) for _ in range(n_buffers)]
    groups = [policy, *drafts]
    grads = Grads(
        students=[
            torch.empty_like(g.student) if need else None
            for g, need in zip(groups, need_grads, strict=True)
        ],
        weight=None,
    )
    bounds = [*range(0, policy.num_rows, chunk), policy.num_rows]
    draft_bounds = [
        torch.searchsorted(pos, torch.tensor(bounds, device=pos.device)).tolist()
        for pos in teacher_positions
    ]

    def accumulate_weight(dz: torch.Tensor, student: torch.Tensor) -> None:
        if grads.weight is None:
            grads.weight = torch.mm(dz.t(), student)
        else:
            grads.weight.addmm_(dz.t(), student)

    def backprop(dz: torch.Tensor, index: int, start: int, stop: int, trains_weight: bool):
        group = groups[index]
        if grads.students[index] is not None:
            torch.mm(dz, weight, out=grads.students[index][start:stop])
        if need_weight_grad and trains_weight:
            accumulate_weight(dz, group.student[start:stop])

    for i in range(len(bounds) - 1):
        start, stop = bounds[i], bounds[i + 1]
        logits = torch.mm(policy.student[start:stop], weight.t(), out=buffers[0][: stop - start])
        for d, draft in enumerate(drafts):
            d_start, d_stop = draft_bounds[d][i], draft_bounds[d][i + 1]
            if d_stop == d_start:
                continue
            student = draft.student[d_start:d_stop]
            draft_logits = torch.mm(student, weight.t(), out=buffers[1 + d][: d_stop - d_start])
            teacher_rows = teacher_positions[d][d_start:d_stop] - start
            _run_draft(
                draft, draft_logits, logits, teacher_rows, d_start, d_stop, vocab_offset, tp_group
            )
            backprop(draft_logits, 1 + d, d_start, d_stop, draft.group.trains_weight)
        teacher = None
        if teacher_hidden is not None:
            teacher = torch.mm(
                teacher_hidden[start:stop], teacher_weight.t(), out=buffers[-1][: stop - start]
            )
        run_rows(
            logits,
            policy,
            start,
            stop,
            vocab_offset=vocab_offset,
            teacher=teacher,
            teacher_rows=None if teacher is None else _arange_like(teacher),
            tp_group=tp_group,
        )
        backprop(logits, 0, start, stop, True)

    if need_weight_grad and grads.weight is None:
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
    topk = draft.flags.topk
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
        values = draft.values[start:stop]
        lse = values[:, 2]
        values[:, 8] = lse - (q * student_at_top).sum(-1)
        w = draft.weights[start:stop, 5:6]
        logits.scatter_add_(1, top_ids, (-w * q).to(logits.dtype))


def _arange_like(rows: torch.Tensor) -> torch.Tensor:
    return torch.arange(rows.shape[0], device=rows.device)
