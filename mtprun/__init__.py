"""mtprun: declarative LLM post-training with a fused one-pass LM-head loss.

Library API::

    from mtprun import HeadInputs, HeadPlan, head_loss
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtprun.compiler import HeadPlan
    from mtprun.kernels import HeadInputs, head_loss

__all__ = ["HeadInputs", "HeadPlan", "head_loss"]


def __getattr__(name: str) -> Any:
    # Lazy so that `mtprun validate` starts without importing torch.
    if name == "HeadPlan":
        from mtprun.compiler import HeadPlan

        return HeadPlan
    if name in ("HeadInputs", "head_loss"):
        import mtprun.kernels

        return getattr(mtprun.kernels, name)
    raise AttributeError(f"module 'mtprun' has no attribute {name!r}")
