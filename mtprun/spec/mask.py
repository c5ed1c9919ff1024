"""`mask:` which tokens the loss trains (docs/concepts.md, "Which tokens train")."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag

Role = Literal["system", "user", "assistant", "tool"]
MaskName = Literal["sampled", "all"]


def _mask_shape(value: Any) -> str:
    # A mapping is a roles table; anything else must be one of the policy names. Choosing the
    # branch up front gives one clear error instead of one per union member.
    return "roles" if isinstance(value, dict) else "policy"


MaskPolicy = Annotated[
    Annotated[MaskName, Tag("policy")] | Annotated[dict[Role, bool], Tag("roles")],
    Discriminator(_mask_shape),
]
"""`sampled`: every token the model sampled (what it emits at inference, stop tokens included);
`all`: every token; a roles table such as `{assistant: true, tool: false}`: sampled tokens of
the roles set to true."""
