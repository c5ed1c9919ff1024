"""MTP draft loss: head k at row t taught by the policy's detached distribution at row t+k.

soft: -sum_v q_v log s_v with q the policy's softmax at t+k (d/du = s - q);
topk: the same with q restricted to the policy's top-k tokens and renormalised;
hard: cross-entropy to the true token targets[t+k] (d/du = s - e_y).
top1_agree (draft argmax == policy argmax) is the speculative-decoding acceptance proxy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mtprun.losses import ce, distill
from mtprun.losses.distill import soft_cross_entropy, soft_grad
from mtprun.losses.kind import TermConfig, TritonCall, TritonRow, UnfusedCost
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.losses.triton_jit import jit, tl


class MTPTerm(TermConfig):
    """Draft loss of the multi-token-prediction heads; never reaches the policy trunk."""

    kind: Literal["mtp"] = Field("mtp", description="Term kind.")
    weight: float = Field(0.3, ge=0, description="Multiplier of the draft loss in the summed loss.")
    depth: int = Field(1, ge=1, description="Number of MTP heads trained (head k predicts t+k).")
    target: Literal["soft", "topk", "hard"] = Field(
        "soft",
        description="soft: the policy's detached distribution at t+k; topk: that restricted to "
        "its top-k tokens; hard: cross-entropy to the true token t+k.",
    )
    topk: int | None = Field(None, ge=1, description="k of target: topk.")
    train_shared_output: bool = Field(
        False, description="Let the draft loss update the shared output layer too."
    )
    separate_optimizer: bool = Field(
        False, description="Give the MTP head its own optimizer and grad clipping."
    )

    @model_validator(mode="after")
    def _topk_matches_target(self) -> MTPTerm:
        if self.target == "topk" and self.topk is None:
            raise ValueError("target 'topk' needs `topk: K` (for example topk: 20)")
        if self.target != "topk" and self.topk is not None:
            raise ValueError(f"`topk` is only used with target 'topk', not '{self.target}'")
        return self


CONFIG = MTPTerm


def needs(term: MTPTerm) -> frozenset[Stat]:
    teacher = {
        "soft": {Stat.TEACHER_LSE, Stat.TEACHER_CROSS},
        "topk": {Stat.TEACHER_TOPK},
        "hard": {Stat.TARGET_LOGIT},
    }[term.target]
    return frozenset({Stat.LSE, Stat.ARGMAX, *teacher})


def metric_names(term: MTPTerm) -> tuple[str, ...]:
    per_head = tuple(
        name for k in range(1, term.depth + 1) for name in (f"mtp/{k}/loss", f"mtp/{k}/top1_agree")
    )
    return ("mtp", *per_head)


def row_loss(term: MTPTerm, stats: RowStats, inputs: RowInputs) -> RowLoss:
    ones = stats.lse.new_ones(())
    if term.target == "soft":
        value, grad = soft_cross_entropy(stats), soft_grad(stats)
    elif term.target == "topk":
        cross = (stats.topk_probs * (stats.topk_logits - stats.max[:, None])).sum(1)
        value, grad = (stats.lse - stats.max) - cross, soft_grad(stats)
    else:
        value, grad = -stats.logprob, GradCoeffs(a=ones, b=-ones)
    agree = (stats.argmax == stats.teacher_argmax).float()
    return RowLoss(value=value, grad=grad, metrics={"top1_agree": agree})


def unfused_cost(term: MTPTerm) -> UnfusedCost:
    # per head: its logits, log-softmax, the teacher's probs
    return UnfusedCost(buffers=3 * term.depth, reductions=5 * term.depth)


def describe(term: MTPTerm) -> tuple[str, str] | None:
    return None


@jit
def _triton_row(w, row, stats, token_inputs, params, a, b, c, d, OPTIONS: tl.constexpr):
    # The top-k target: w p here; the caller subtracts the sparse w q_topk and writes the
    # value into the soft-CE column (the top-k spans the whole vocabulary).
    return a + w, b, c, d, ()


TRITON_ROW = TritonRow(name="plain", function=_triton_row, per_token=distill.SOFT_CE)


def triton(term: MTPTerm, *, has_old: bool, has_ref: bool) -> TritonCall:
    row = {"soft": distill.TRITON_ROW, "topk": TRITON_ROW, "hard": ce.TRITON_ROW}[term.target]
    return TritonCall(row)
