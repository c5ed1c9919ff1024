"""Recipe -> HeadPlan."""

from mtprun.compiler.plan import HeadPlan

__all__ = ["HeadPlan"]
