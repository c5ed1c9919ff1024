"""Every variant of the Triton row kernel, and the selection and scaling kernels, compile for an
H100 (sm_90) on a machine without a GPU: Triton's bundled ptxas builds the cubin. This
catches what the interpreter accepts but the compiler refuses (a non-constexpr global, a
type mismatch in a loop-carried value)."""

from __future__ import annotations

import inspect
import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real kernels: run without TRITON_INTERPRET", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mtprun.kernels.triton import rows, scale, select  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
MINIMAL = {
    "HAS_CE": True,
    "HAS_Z": False,
    "HAS_GRPO": False,
    "HAS_OLD": False,
    "KL_ESTIMATOR": 0,
    "SEQ_RATIO": False,
    "CISPO": False,
    "DUAL_CLIP": False,
    "HAS_IS_WEIGHT": False,
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
    "SEQ_RATIO": True,
    "CISPO": False,
    "DUAL_CLIP": True,
    "HAS_IS_WEIGHT": True,
    "HAS_ENTROPY_BONUS": True,
    "HAS_TEACHER": True,
    "HAS_PLAIN": True,
    "ARGMAX": True,
}
_SCALARS = {
    "inv_temperature": "fp32",
    "clip_low": "fp32",
    "clip_high": "fp32",
    "clip_c": "fp32",
    "kl_coef": "fp32",
}


def _signature(
    kernel, pointers: dict[str, str], other_pointers: str, scalars: dict[str, str] | None = None
) -> dict[str, str]:
    """Triton types of `kernel`'s parameters: constexprs by their upper-case names, pointers
    (`*_ptr`) from `pointers` or else `other_pointers`, scalars from `scalars` or else i32."""
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name.isupper():
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, other_pointers)
        else:
            signature[name] = (scalars or {}).get(name, "i32")
    return signature


def _row_kernel_signature(logits_type: str) -> dict[str, str]:
    pointers = {"logits_ptr": f"*{logits_type}", "teacher_ptr": f"*{logits_type}"}
    pointers |= {"targets_ptr": "*i64", "teacher_rows_ptr": "*i64"}
    return _signature(rows.head_rows_kernel, pointers, "*fp32", _SCALARS)


MODES = {"fused": rows.FUSED.value, "stats": rows.STATS.value, "grad": rows.GRAD.value}
VARIANTS = [
    *((mode, "ce", "bf16") for mode in MODES),
    *((mode, "all", "bf16") for mode in MODES),
    ("fused", "all", "fp32"),
    ("fused", "k1", "bf16"),
    ("grad", "cispo", "bf16"),
]
FLAGS = {
    "ce": MINIMAL,
    "all": EVERYTHING,
    "k1": {**EVERYTHING, "KL_ESTIMATOR": 1},
    "cispo": {**EVERYTHING, "CISPO": True, "DUAL_CLIP": False},
}


@pytest.mark.parametrize(("mode", "flags", "logits_type"), VARIANTS)
def test_row_kernel_compiles_for_sm90(mode: str, flags: str, logits_type: str) -> None:
    constexprs = {**FLAGS[flags], "MODE": MODES[mode], "BLOCK_V": 8192}
    source = ASTSource(
        fn=rows.head_rows_kernel,
        signature=_row_kernel_signature(logits_type),
        constexprs=constexprs,
    )
    compiled = triton.compile(source, target=H100, options={"num_warps": 8})
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("hidden_type", ["bf16", "fp32"])
def test_selection_kernel_compiles_for_sm90(hidden_type: str) -> None:
    kernel = select.select_rows_kernel
    signature = _signature(kernel, {"mask_ptr": "*i1", "hidden_ptr": f"*{hidden_type}"}, "*i64")
    constexprs = {"BLOCK_R": 16, "BLOCK_H": 1024, "BLOCK_S": 1024, "BLOCK_M": 8192}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    assert triton.compile(source, target=H100, options={"num_warps": 8}).asm["cubin"]


@pytest.mark.parametrize("grad_type", ["bf16", "fp32"])
def test_scale_kernel_compiles_for_sm90(grad_type: str) -> None:
    kernel = scale.scale_kernel
    signature = _signature(kernel, {"x_ptr": f"*{grad_type}"}, "*fp32", {"numel": "i64"})
    source = ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK": 4096})
    assert triton.compile(source, target=H100, options={"num_warps": 4}).asm["cubin"]
