"""`rollout.partial` held against the rest of the recipe (rollout/partial.py says what it
does): it needs a generation running ahead of the trainer to interrupt, and old log-probs
from one policy for the importance correction of tokens sampled by several."""

from __future__ import annotations

from collections.abc import Iterator

from mtprun.preflight.rules import PREFLIGHT_RULES
from mtprun.spec.recipe import Recipe
from mtprun.spec.rules import Issue

rule = PREFLIGHT_RULES.rule


@rule("rollout", "trainer", "task", "mask")
def _partial_rollouts_fit_the_loop(r: Recipe) -> Iterator[Issue]:
    rollout = r.rollout
    if r.task is None:
        return
    if not rollout.partial:
        if rollout.max_offpolicy_steps is not None:
            yield Issue(
                ("rollout", "max_offpolicy_steps"),
                "bounds how old a token of a partial rollout may be; without rollout.partial "
                "every episode is sampled by one policy at most rollout.max_staleness steps "
                "old, and this has no effect",
                "warning",
            )
        return
    if rollout.max_staleness < 1:
        yield Issue(
            ("rollout", "partial"),
            "partial rollouts let a weight update land inside a generation that runs ahead "
            "of the trainer: set rollout.max_staleness: 1 (or more)",
        )
    if not rollout.recompute_logprobs:
        yield Issue(
            ("rollout", "partial"),
            "a partial rollout's tokens come from several policies, so the old log-probs must "
            "be the trainer's own (the engines' become the sampler's, for the importance "
            "correction): set rollout.recompute_logprobs: true",
        )
    if r.trainer.router_replay:
        yield Issue(
            ("rollout", "partial"),
            "router replay needs one routing of each whole response, and a continued response "
            "is routed anew by each policy: turn trainer.router_replay off",
        )
    if rollout.max_offpolicy_steps is not None and r.mask == "all":
        yield Issue(
            ("rollout", "max_offpolicy_steps"),
            "too old tokens leave the loss as tokens the model did not sample do, and `mask: "
            "all` trains those too: use `mask: sampled` (or a roles table)",
        )
    if rollout.partial_chunk_tokens >= rollout.max_tokens:
        yield Issue(
            ("rollout", "partial_chunk_tokens"),
            f"a chunk of {rollout.partial_chunk_tokens} tokens holds a whole turn "
            f"(rollout.max_tokens {rollout.max_tokens}): no weight update can land inside "
            "one; use fewer tokens",
            "warning",
        )
