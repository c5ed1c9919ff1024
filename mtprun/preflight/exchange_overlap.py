"""Whether the trainer overlaps the expert-parallel exchange with compute by running each micro
batch as two halves on two CUDA streams (`mtprun.runner.trainer.half_batches`)."""

from __future__ import annotations

from mtprun.spec import Recipe


def halves_blocker(recipe: Recipe) -> str | None:
    """Why a CUDA trainer of `recipe` runs each micro batch through its layers whole; None
    where it halves every micro batch of two sequences or more."""
    if recipe.parallel.ep == 1:
        return "there is no exchange to overlap (parallel.ep 1)"
    if recipe.parallel.cp > 1:
        return "parallel.cp splits each sequence over ranks instead"
    if recipe.trainer.recompute != "none":
        return f"trainer.recompute {recipe.trainer.recompute} runs layers again in the backward"
    if any(term.kind == "router_aux" and term.weight for term in recipe.losses):
        return "the router_aux loss balances a whole micro batch's routing, not each half's"
    if recipe.trainer.router_replay:
        return "trainer.router_replay hands the routers a whole micro batch's routing"
    return None
