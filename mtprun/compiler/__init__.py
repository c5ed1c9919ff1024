"""Recipe -> HeadPlan."""

from mtprun.compiler.compile import compile_recipe
from mtprun.compiler.plan import HeadPlan

__all__ = ["HeadPlan", "compile_recipe"]
