"""Loss-mask policies: which tokens of a rendered sequence the loss trains.

- "sampled" (default): every token the model sampled (what it emits at inference, its stop
  token included).
- "all": every token, whatever the template.
- a roles table such as {"assistant": True, "tool": False}: sampled tokens whose author role
  is set to true; roles left out count as false.

This gives the mask of each TOKEN. For next-token training the loss at position t trains
token t+1; `mtprun.data.packing` does that one shift when it builds `PackedBatch.loss_mask`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from mtprun.data.messages import ROLES
from mtprun.data.render import ROLE_IDS, RenderedSequence

MaskPolicy = Literal["sampled", "all"] | Mapping[str, bool]


def token_mask(sequence: RenderedSequence, policy: MaskPolicy) -> torch.Tensor:
    """[N] bool: True where `policy` trains the token of `sequence`."""
    if policy == "all":
        return torch.ones_like(sequence.is_sampled)
    if policy == "sampled":
        return sequence.is_sampled.clone()
    if isinstance(policy, Mapping):
        return sequence.is_sampled & torch.isin(sequence.roles, _enabled_role_ids(policy))
    raise ValueError(
        f"mask policy {policy!r} is not one of 'sampled', 'all' or a roles table "
        "such as {assistant: true, tool: false}"
    )


def _enabled_role_ids(table: Mapping[str, bool]) -> torch.Tensor:
    unknown = sorted(set(table) - set(ROLES))
    if unknown:
        raise ValueError(f"mask roles table: unknown roles {unknown}; the roles are {ROLES}")
    return torch.tensor([ROLE_IDS[r] for r, on in table.items() if on], dtype=torch.int8)
