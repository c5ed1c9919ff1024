"""The mixture-of-experts part of a model shape, and how each MoE family's config.json
declares it. Imports no torch: `mtprun validate` reads shapes through it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class ExpertShape:
    """A mixture-of-experts MLP: `count` routed experts of FFN width `intermediate`, each token
    routed to `top_k` of them by a linear router over the hidden state.

    Routing: `score` turns router logits into scores (softmax over all experts, or a sigmoid
    per expert); with `score_bias` a learned-free correction bias per expert is added for the
    choice only (GLM-4.5's `e_score_correction_bias`); `groups` / `group_top_k` first keep the
    best `group_top_k` of `groups` expert groups (DeepSeek-V3 / GLM-4.5 grouped top-k); the
    chosen scores are renormalised to sum to one when `normalize_top_k` and then multiplied by
    `scaling` (`routed_scaling_factor`). A `shared_intermediate` > 0 adds an always-on shared
    expert of that width. The layers in `dense_layers` keep the dense MLP of the core's
    `intermediate` width.
    """

    count: int
    top_k: int
    intermediate: int
    normalize_top_k: bool = True
    score: Literal["softmax", "sigmoid"] = "softmax"
    score_bias: bool = False
    groups: int = 1
    group_top_k: int = 1
    scaling: float = 1.0
    shared_intermediate: int = 0
    dense_layers: tuple[int, ...] = ()

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` (0-based) has experts."""
        return index not in self.dense_layers


def qwen3_moe_experts(config: Mapping[str, Any]) -> ExpertShape:
    """Qwen3-MoE: softmax router, no shared expert; layer i is sparse unless it is listed in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`."""
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    return ExpertShape(
        # transformers 5 writes the count as num_local_experts; the released configs as
        # num_experts.
        count=int(config.get("num_experts") or config["num_local_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        intermediate=int(config["moe_intermediate_size"]),
        normalize_top_k=bool(config.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(layers) if i in dense_only or (i + 1) % step),
    )


def glm4_moe_experts(config: Mapping[str, Any]) -> ExpertShape:
    """GLM-4.5 / 4.6: sigmoid router with a per-expert score-correction bias and grouped
    top-k, scaled weights, `n_shared_experts` shared experts (one MLP of their summed width);
    the first `first_k_dense_replace` layers are dense."""
    shared = int(config.get("n_shared_experts") or 0)
    width = int(config["moe_intermediate_size"])
    return ExpertShape(
        count=int(config["n_routed_experts"]),
        top_k=int(config["num_experts_per_tok"]),
        intermediate=width,
        normalize_top_k=bool(config.get("norm_topk_prob", True)),
        score="sigmoid",
        score_bias=True,
        groups=int(config.get("n_group") or 1),
        group_top_k=int(config.get("topk_group") or 1),
        scaling=float(config.get("routed_scaling_factor") or 1.0),
        shared_intermediate=shared * width,
        dense_layers=tuple(range(int(config.get("first_k_dense_replace") or 0))),
    )
