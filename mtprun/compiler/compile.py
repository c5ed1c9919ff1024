"""Recipe -> HeadPlan."""

from __future__ import annotations

from mtprun.compiler.plan import HeadPlan
from mtprun.losses import LossTerm, is_trunk_term
from mtprun.spec.recipe import Recipe


def compile_recipe(recipe: Recipe) -> HeadPlan:
    """The fused head-loss plan of `recipe`: its loss terms, vocab split over `parallel.tp`,
    the sampler's log-probs taken when the trainer recomputes the old ones (RL), and the
    constant length L of `seq-mean-token-sum-norm`."""
    rl = recipe.task is not None
    return HeadPlan.compile(
        head_terms(recipe),
        tp_size=recipe.parallel.tp,
        sampler_logprobs=rl and recipe.rollout.recompute_logprobs,
        norm_length=sum_norm_length(recipe),
    )


def sum_norm_length(recipe: Recipe) -> int | None:
    """Dr. GRPO's constant: the most tokens one sequence can train, whatever the batch holds.
    RL: the generation budget (rollout.max_tokens per turn x task.max_turns); SFT: a packed
    row (data.packing_length). None when no term aggregates with seq-mean-token-sum-norm."""
    if not any(t.loss_agg == "seq-mean-token-sum-norm" for t in head_terms(recipe)):
        return None
    if recipe.task is not None:
        return recipe.rollout.max_tokens * recipe.task.max_turns
    return recipe.data.packing_length if recipe.data is not None else None


def head_terms(recipe: Recipe) -> list[LossTerm]:
    """The recipe's head terms: its `losses:` without the trunk terms (router losses), which
    megatron-core's router computes inside the trunk."""
    return [t for t in recipe.losses if not is_trunk_term(t)]
