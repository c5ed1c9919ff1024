"""The router's trunk losses of a mixture-of-experts model: recipe terms that are not head
terms. Megatron-core's router adds them inside each MoE layer, on the router's own logits and
scores; the fused head loss never sees them. Their recipe weight is the coefficient.

- router_aux (load balancing, Switch Transformer): per layer, over the micro batch's T tokens
  routed to k of E experts, E / (k T) * sum_e f_e P_e, where f_e counts the tokens sent to
  expert e and P_e sums the router scores of expert e; 1 when the load is even.
- router_z (ST-MoE): the mean over tokens of logsumexp(router logits)^2.
Each micro batch's share weighs them like the head loss (its share of the step's trained
tokens), so the step's value is the token-weighted mean over micro batches.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TrunkTermConfig(BaseModel):
    """A loss computed inside the trunk (not by the head kernel): a kind and a weight."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1e-3, ge=0, description="Coefficient of this trunk loss.")

    def describe(self) -> tuple[str, str]:
        """Its `mtprun plan` line: a trunk loss, not a head term."""
        return (
            self.kind,
            f"weight {self.weight:g}: a trunk loss, added by megatron-core's router in every "
            "MoE layer; not a head term (the fused head kernel does not compute it)",
        )


class RouterAuxLossTerm(TrunkTermConfig):
    """The router's load-balancing loss (mixture-of-experts models)."""

    kind: Literal["router_aux"] = Field("router_aux", description="Term kind.")


class RouterZLossTerm(TrunkTermConfig):
    """The router's z-loss, logsumexp(router logits)^2 (mixture-of-experts models)."""

    kind: Literal["router_z"] = Field("router_z", description="Term kind.")


TRUNK_CONFIGS: tuple[type[TrunkTermConfig], ...] = (RouterAuxLossTerm, RouterZLossTerm)
