"""`mtprun plan`'s mixture-of-experts table: the experts, their router, the sparse and dense
layers, the experts and expert parameters per rank, the token exchange between
expert-parallel ranks and the ranks that sum an expert's gradients."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.table import Table

from mtprun.cli.tables import key_value_table

if TYPE_CHECKING:
    from mtprun.models.shape import ModelShape
    from mtprun.preflight.memory import TrainerMemory
    from mtprun.spec.recipe import Recipe


def experts_layout(recipe: Recipe, memory: TrainerMemory | str) -> dict | None:
    """A mixture-of-experts model's experts per rank and sparse / dense layers (null for a
    dense model or one whose shape is not known here)."""
    from mtprun.preflight.model_shape import recipe_shape

    shape = recipe_shape(recipe)
    if isinstance(shape, str) or shape.experts is None:
        return None
    moe, ep = shape.experts, recipe.parallel.ep
    sparse = [i for i in range(shape.layers) if shape.is_moe_layer(i)]
    layout = {
        "count": moe.count,
        "top_k": moe.top_k,
        "intermediate": moe.intermediate,
        "shared_intermediate": moe.shared_intermediate,
        "router": _router(shape),
        "ep": ep,
        "experts_per_rank": moe.count // ep,
        "sparse_layers": len(sparse),
        "dense_layers": [i for i in range(shape.layers) if not shape.is_moe_layer(i)],
        "expert_data_parallel": recipe.parallel.dp * recipe.parallel.cp // ep,
        "sent_copies_per_token": _sent_copies(moe.count, moe.top_k, ep),
    }
    if not isinstance(memory, str):
        layout["rank_sparse_layers"] = memory.sparse_layers
        layout["rank_expert_params"] = memory.expert_params
    return layout


def _sent_copies(experts: int, top_k: int, ep: int) -> float:
    """Rows a token sends under uniform routing (RankDedupDispatcher: one to each rank that
    holds any of its top_k experts): ep P(a rank holds one), 0 without expert parallelism."""
    if ep == 1:
        return 0.0
    missed = math.comb(experts - experts // ep, top_k) / math.comb(experts, top_k)
    return round(ep * (1 - missed), 2)


def _exchange_text(layout: dict) -> str:
    k, ep = layout["top_k"], layout["ep"]
    if ep == 1:
        return (
            f"none (parallel.ep 1): each token is copied to its {k} experts on its own rank and "
            "their outputs summed back in float32"
        )
    return (
        f"all-to-all over the {ep} expert-parallel ranks: each token sent once to each rank "
        f"that holds any of its {k} experts ({layout['sent_copies_per_token']:g} copies a token "
        f"under uniform routing, where one per expert would be {k}), then copied to its "
        "experts there; not overlapped with compute: each layer waits for its exchange and "
        "for the busiest rank's experts (train/moe/ep_load_max_over_mean)"
    )


def _router(shape: ModelShape) -> str:
    moe = shape.experts
    assert moe is not None
    how = "softmax" if moe.score == "softmax" else "sigmoid"
    if moe.score_bias:
        how += " with a score-correction bias"
    if moe.groups > 1:
        how += f", top {moe.group_top_k} of {moe.groups} groups"
    if moe.normalize_top_k:
        how += ", top-k renormalised"
    if moe.scaling != 1.0:
        how += f", scaled by {moe.scaling:g}"
    return how


def experts_table(layout: dict) -> Table:
    table = key_value_table("mixture of experts")
    shared = layout["shared_intermediate"]
    table.add_row(
        "experts",
        f"{layout['count']} routed of width {layout['intermediate']} a sparse layer, top "
        f"{layout['top_k']} a token; "
        + (f"a shared expert of width {shared}" if shared else "no shared expert"),
    )
    table.add_row("router", layout["router"])
    dense = layout["dense_layers"]
    listed = f" ({', '.join(map(str, dense))})" if 0 < len(dense) <= 8 else ""
    table.add_row("layers", f"{layout['sparse_layers']} sparse, {len(dense)} dense{listed}")
    ep, per_rank = layout["ep"], layout["experts_per_rank"]
    rank = (
        f"{per_rank} of {layout['count']} a sparse layer (parallel.ep {ep}: "
        f"{layout['count']} / {ep})"
    )
    if "rank_sparse_layers" in layout:
        held = layout["rank_sparse_layers"] * per_rank
        rank += f"; {held} on a rank ({layout['rank_sparse_layers']} sparse layers)"
    table.add_row("experts per rank", rank)
    table.add_row("token exchange", _exchange_text(layout))
    if "rank_expert_params" in layout:
        n = layout["rank_expert_params"]
        count = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
        table.add_row("expert parameters per rank", count)
    group = layout["expert_data_parallel"]
    summed = (
        f"summed over the {group} ranks that hold the same experts (dp x cp / ep)"
        if group > 1
        else "each expert lives on one rank (dp x cp / ep = 1): not summed"
    )
    table.add_row(
        "expert gradients",
        f"{summed}; the gradient norm sums the experts' squares over the expert-parallel group",
    )
    return table
