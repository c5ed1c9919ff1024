"""What a mixture-of-experts model's routers did in a training step, and the weight of their
trunk losses per micro batch.

`RouterStats` weighs the router losses of each micro batch (`weigh_micro_batch`), and watches
every megatron-core `TopKRouter` of this stage while the model trains:
its logits (the router's `gating`) and its routing map [T, E]. Per step it reports
- `moe/load_max_over_mean`: per layer, the busiest expert's token count over the mean count
  (summed over the data-parallel ranks, whose tokens differ), the worst layer's (1 = even);
- `moe/aux_loss`: the load-balancing loss E / (k T^2) sum_e n_e S_e (n_e tokens sent to
  expert e, S_e its summed router scores, T tokens, k chosen per token; 1 when even), the
  token-weighted mean over micro batches, averaged over layers and data-parallel ranks. It is
  measured whether or not the recipe trains it (`router_aux`);
- under expert parallelism, `moe/ep_load_max_over_mean`: per layer, the busiest
  expert-parallel rank's (token, expert) pairs over the mean rank's (its experts' counts
  summed as above), averaged over the layers: each layer's other ranks wait for the busiest
  at its combine, so 1.1 means the experts' part of the step runs ~10% longer than an even
  routing's (summed over the step's micro batches, whose own imbalances can be larger).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter


class RouterStats:
    """Routing metrics of one pipeline stage's MoE layers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, ep_size: int = 1) -> None:
        """`ep_size`: the expert-parallel ranks, each holding a contiguous 1/ep_size of every
        layer's experts (rank-major, as megatron-core places them)."""
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.ep_size = ep_size
        # The recipe's coefficients (router_aux, router_z), before any micro batch's weight.
        self._coefs = [
            (r.config.moe_aux_loss_coeff, r.config.moe_z_loss_coeff) for r in self.routers
        ]
        self._logits: dict[int, torch.Tensor] = {}
        self._counts: list[torch.Tensor | float] = [0.0] * len(self.routers)
        self._aux: list[torch.Tensor | float] = [0.0] * len(self.routers)
        self._tokens = 0
        self._counting = True  # off for a micro batch that trains nothing (weigh_micro_batch)
        for index, router in enumerate(self.routers):
            router.gating = self._keep_logits(index, router.gating)
            router.register_forward_hook(self._observe(index))

    def _keep_logits(self, index: int, gating: Any) -> Any:
        def gating_kept(hidden: torch.Tensor) -> torch.Tensor:
            logits = gating(hidden)
            if torch.is_grad_enabled():
                self._logits[index] = logits.detach()
            return logits

        return gating_kept

    def _observe(self, index: int) -> Any:
        def hook(router: TopKRouter, inputs: Any, outputs: tuple[torch.Tensor, ...]) -> None:
            logits = self._logits.pop(index, None)
            if logits is None or not router.training or not self._counting:
                return
            routing_map = outputs[1]
            counts = routing_map.sum(0).double()
            scores = logits.double().softmax(-1)
            if router.score_function == "sigmoid":
                scores = logits.double().sigmoid()
                scores = scores / scores.sum(-1, keepdim=True)
            tokens, experts = routing_map.shape
            aux = experts / (router.topk * tokens) * (counts * scores.sum(0)).sum() / tokens
            self._counts[index] = self._counts[index] + counts
            self._aux[index] = self._aux[index] + aux * tokens
            if index == 0:
                self._tokens += tokens

        return hook

    def weigh_micro_batch(self, share: float, tokens: int) -> None:
        """The router losses of the next micro batch weigh `share` (its share of the step's
        trained tokens, as its head loss does).

        megatron-core multiplies each router loss by its coefficient when the layer runs
        forward, and by the micro batch's `tokens` (its per-token-loss convention, with a
        backward scale of 1 that its schedule sets after every forward): so the coefficient
        of this micro batch's forward is the recipe's times share / tokens. Its tracker
        divides by the same coefficient, so logged values stay unscaled. A micro batch of
        share 0 (one that trains nothing, run only for the exchange under expert parallelism)
        is left out of the step's metrics as well.
        """
        self._counting = share > 0
        for router, (aux, z) in zip(self.routers, self._coefs, strict=True):
            if aux:
                router.config.moe_aux_loss_coeff = aux * share / tokens
            if z:
                router.config.moe_z_loss_coeff = z * share / tokens

    def step_metrics(self, dp_group: dist.ProcessGroup | None) -> dict[str, Any]:
        """This step's metrics as device scalars (one reduction over the data-parallel
        group), and a fresh start for the next step; {} without routers or tokens."""
        # Routers that saw no token this step (MTP layers without an mtp term) are left out.
        seen = [i for i, c in enumerate(self._counts) if isinstance(c, torch.Tensor)]
        if not seen or not self._tokens:
            return {}
        counts = torch.stack([self._counts[i] for i in seen])
        aux = torch.stack([self._aux[i] for i in seen]) / self._tokens
        summed = torch.cat([counts.flatten(), aux])
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(summed, group=dp_group)
            summed[counts.numel() :] /= dist.get_world_size(dp_group)
        counts = summed[: counts.numel()].view_as(counts)
        load = _busiest_over_mean(counts)
        self._counts = [0.0] * len(self.routers)
        self._aux = [0.0] * len(self.routers)
        self._tokens = 0
        metrics = {
            "moe/load_max_over_mean": load.max(),
            "moe/aux_loss": summed[counts.numel() :].mean(),
        }
        if self.ep_size > 1:
            metrics["moe/ep_load_max_over_mean"] = _busiest_over_mean(
                counts.view(len(seen), self.ep_size, -1).sum(-1)
            ).mean()
        return metrics


def _busiest_over_mean(loads: torch.Tensor) -> torch.Tensor:
    """[..., N] loads -> [...] the largest over the mean (1 = even)."""
    return loads.max(-1).values / loads.mean(-1).clamp_min(1e-12)
