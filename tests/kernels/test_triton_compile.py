"""Every variant of the Triton row kernel compiles for an H100 (sm_90) on a machine without a
GPU: Triton's bundled ptxas builds the cubin. This catches what the interpreter accepts but
the compiler refuses (a non-constexpr global, a type mismatch in a loop-carried value)."""

from __future__ import annotations

import inspect
import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real kernels: run without TRITON_INTERPRET", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mtprun.kernels.triton import rows  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
MINIMAL = {
    "HAS_CE": True,
    "HAS_Z": False,
    "HAS_GRPO": False,
    "HAS_OLD": False,
    "KL_ESTIMATOR": 0,
    "HAS_ENTROPY_BONUS": False,
    "HAS_TEACHER": False,
    "HAS_PLAIN": False,
    "ARGMAX": False,
}
EVERYTHING = {
    "HAS_CE": True,
    "HAS_Z": True,
    "HAS_GRPO": True,
    "HAS_OLD": True,
    "KL_ESTIMATOR": 3,
    "HAS_ENTROPY_BONUS": True,
    "HAS_TEACHER": True,
    "HAS_PLAIN": True,
    "ARGMAX": True,
}
_SCALARS = {"inv_temperature": "fp32", "clip_low": "fp32", "clip_high": "fp32", "kl_coef": "fp32"}
_INT_POINTERS = {"targets_ptr", "teacher_rows_ptr"}


def _signature(logits_type: str) -> dict[str, str]:
    signature = {}
    for name in inspect.signature(rows.head_rows_kernel.fn).parameters:
        if name.isupper():
            signature[name] = "constexpr"
        elif name in ("logits_ptr", "teacher_ptr"):
            signature[name] = f"*{logits_type}"
        elif name.endswith("_ptr"):
            signature[name] = "*i64" if name in _INT_POINTERS else "*fp32"
        else:
            signature[name] = _SCALARS.get(name, "i32")
    return signature


MODES = {"fused": rows.FUSED.value, "stats": rows.STATS.value, "grad": rows.GRAD.value}
VARIANTS = [
    *((mode, "ce", "bf16") for mode in MODES),
    *((mode, "all", "bf16") for mode in MODES),
    ("fused", "all", "fp32"),
    ("fused", "k1", "bf16"),
]
FLAGS = {"ce": MINIMAL, "all": EVERYTHING, "k1": {**EVERYTHING, "KL_ESTIMATOR": 1}}


@pytest.mark.parametrize(("mode", "flags", "logits_type"), VARIANTS)
def test_row_kernel_compiles_for_sm90(mode: str, flags: str, logits_type: str) -> None:
    constexprs = {**FLAGS[flags], "MODE": MODES[mode], "BLOCK_V": 8192}
    source = ASTSource(
        fn=rows.head_rows_kernel, signature=_signature(logits_type), constexprs=constexprs
    )
    compiled = triton.compile(source, target=H100, options={"num_warps": 8})
    assert compiled.asm["cubin"]
