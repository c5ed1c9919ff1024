"""MTP draft loss: head k at row t taught by the policy's detached distribution at row t+k."""

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
