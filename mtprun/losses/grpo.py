"""GRPO / PPO-clip with a KL to a reference: a function of logp_y = z_y - lse only."""

from mtprun.losses.stats import Stat
from mtprun.spec.losses import GRPOTerm


def needs(term: GRPOTerm) -> frozenset[Stat]:
    return frozenset({Stat.LSE, Stat.TARGET_LOGIT})


def metric_names(term: GRPOTerm) -> tuple[str, ...]:
    return ("grpo", "grpo/clip_frac", "grpo/kl", "grpo/ratio_mean")
