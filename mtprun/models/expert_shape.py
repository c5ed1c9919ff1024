"""The mixture-of-experts part of a model shape (each MoE family's folder reads it from its
config.json: `Family.experts`). Imports no torch: `mtprun validate` reads shapes through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
