"""Router replay (R3): the policy's MoE routers route rollout tokens to the experts the rollout
engine routed them to (`trainer.router_replay`).

The hook is megatron-core's: `TopKRouter.routing` hands its top-k choice to
`router.router_replay.get_replay_topk(scores, topk, num_groups, group_topk, default)` when the
router has one (`moe_enable_routing_replay` only makes it build megatron's own
`RouterReplay`, which replays every token of a call and keeps its instances in a process-wide
list). `ReplayRouting` puts its own object there on each trunk router of the policy, which
replays per token: a token with a known routing (`PackedBatch.routed_experts` >= 0) takes
those experts, any other token the router's own top k (so padding, the last token of a
trajectory, or a whole SFT batch route as usual). The chosen experts' probabilities are the
trainer's scores gathered at them (softmax over the chosen logits when top k is
renormalised, the softmax over every expert otherwise, sigmoid scores renormalised), exactly
what the router computes for its own choice. Ids are global expert ids, under expert
parallelism too: the router scores every expert, the dispatcher sends the tokens on.

Layer l of the routing ([T, layers, k], the rollout engine's decoder layer order, dense
layers' rows ignored) goes to the router of decoder layer l + 1 (megatron's global
`layer_number`); MTP layers' routers are not replayed. Recomputation (`trainer.recompute`)
runs a layer's router again inside backward: each router keeps the routing of every
training forward it ran, and a call made during backward takes the oldest (1F1B runs the
backward passes of a stage in the order of their forwards).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class _LayerReplay:
    """What one router's `router_replay` slot holds (see the module docstring)."""

    def __init__(self, router: TopKRouter, layer: int) -> None:
        self.router = router
        self.layer = layer
        self.target: torch.Tensor | None = None  # [T, k] expert ids, -1 rows route as usual
        self._for_backward: collections.deque[torch.Tensor | None] = collections.deque()
        self.last_routing: torch.Tensor | None = None  # [T, k] ids it chose last (tests)

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        probs, indices = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if torch._C._current_graph_task_id() != -1:  # recomputed inside backward
            target = self._for_backward.popleft() if self._for_backward else None
        else:
            target = self.target
            if self.router.training:
                self._for_backward.append(target)
        if target is not None:
            if target.shape != indices.shape:
                raise ValueError(
                    f"router replay: layer {self.layer} got a routing of shape "
                    f"{tuple(target.shape)} for {tuple(indices.shape)} (tokens, top k) choices"
                )
            target = target.to(device=indices.device)
            known = (target >= 0).all(-1, keepdim=True)
            indices = torch.where(known, target.to(indices.dtype), indices)
            probs = scores.gather(1, indices)
        self.last_routing = indices.detach()
        return probs, indices

    def clear(self) -> None:
        self.target = None
        self._for_backward.clear()


class ReplayRouting:
    """Replays given routings on the trunk routers of `model` (a pipeline stage's layers of a
    model with `layers` decoder layers)."""

    def __init__(self, model: torch.nn.Module, layers: int) -> None:
        self.layers: dict[int, _LayerReplay] = {}
        for module in model.modules():
            if not isinstance(module, TopKRouter) or module.layer_number is None:
                continue
            layer = module.layer_number - 1
            if layer >= layers:
                continue  # an MTP layer's router: the engine's routing has no row for it
            if module.config.moe_router_fusion:
                raise ValueError("router replay needs moe_router_fusion off (the fused top-k)")
            replay = _LayerReplay(module, layer)
            module.router_replay = replay
            self.layers[layer] = replay

    def begin_step(self) -> None:
        """Forget the routings kept for recomputation (a new step's forwards start)."""
        for replay in self.layers.values():
            replay.clear()

    @contextlib.contextmanager
    def replaying(self, routed_experts: torch.Tensor | None) -> Iterator[None]:
        """Within: the routers route the micro batch's tokens by `routed_experts` ([T, layers,
        k] global expert ids, -1 on tokens whose routing is unknown; T this rank's tokens in
        the order the layers see them), or as usual when it is None."""
        try:
            for layer, replay in self.layers.items():
                if routed_experts is None:
                    replay.target = None
                    continue
                if layer >= routed_experts.shape[1]:
                    raise ValueError(
                        f"router replay: the rollout routing has {routed_experts.shape[1]} "
                        f"layers and the policy's MoE layer {layer} has none"
                    )
                replay.target = routed_experts[:, layer]
            yield
        finally:
            for replay in self.layers.values():
                replay.target = None

    def last_routing(self) -> dict[int, torch.Tensor]:
        """layer -> [T, k] experts each router chose in its last call (for tests)."""
        return {
            layer: replay.last_routing
            for layer, replay in self.layers.items()
            if replay.last_routing is not None
        }


def routed_experts_of(batch: Any, index: torch.Tensor | None) -> torch.Tensor | None:
    """The batch's routing of this rank's tokens (`index`: their positions in the row under
    context parallelism; None: all of them)."""
    routed = getattr(batch, "routed_experts", None)
    if routed is None or index is None:
        return routed
    return routed[index.to(routed.device)]
