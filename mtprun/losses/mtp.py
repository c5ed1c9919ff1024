"""MTP draft loss: head k at row t taught by the policy's detached distribution at row t+k.

soft: -sum_v q_v log s_v with q the policy's softmax at t+k (d/du = s - q);
topk: the same with q restricted to the policy's top-k tokens and renormalised;
hard: cross-entropy to the true token targets[t+k] (d/du = s - e_y).
top1_agree (draft argmax == policy argmax) is the speculative-decoding acceptance proxy.
"""

from mtprun.losses.distill import soft_cross_entropy, soft_grad
from mtprun.losses.rows import GradCoeffs, RowInputs, RowLoss, RowStats
from mtprun.losses.stats import Stat
from mtprun.spec.losses import MTPTerm


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
