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

from pydantic import TypeAdapter  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mtprun import losses  # noqa: E402
from mtprun.kernels.triton import groups, rows, scale, select  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
_GRPO = {"kind": "grpo", "ratio": "sequence", "clip_c": 3.0, "tis_cap": 2.0, "kl_coef": 0.1}
MINIMAL = [{"kind": "ce"}]
# Every row function with its heaviest options (one group never has them all, the kernel can).
EVERYTHING = [
    {"kind": "ce"},
    {"kind": "z_loss"},
    _GRPO,
    {"kind": "entropy", "coef": 0.01},
    {"kind": "distill", "teacher": "t"},
    {"kind": "mtp", "target": "topk", "topk": 4},
]
_TERMS = TypeAdapter(list[losses.LossTerm])


def _kernel_terms(terms: list[dict]) -> groups.KernelTerms:
    calls = tuple(
        losses.triton(t, has_old=True, has_ref=True) for t in _TERMS.validate_python(terms)
    )
    return groups.kernel_terms(calls, argmax=any(t["kind"] == "mtp" for t in terms))


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


def _row_kernel_signature(logits_type: str, terms: groups.KernelTerms) -> dict[str, str]:
    pointers = {"logits_ptr": f"*{logits_type}", "teacher_ptr": f"*{logits_type}"}
    pointers |= {"targets_ptr": "*i64", "teacher_rows_ptr": "*i64"}
    scalars = {
        "inv_temperature": "fp32",
        "token_inputs": ("*fp32",) * 5,
        "row_params": tuple(("fp32",) * len(p) for p in terms.params),
    }
    return _signature(rows.head_rows_kernel, pointers, "*fp32", scalars)


MODES = {"fused": rows.FUSED.value, "stats": rows.STATS.value, "grad": rows.GRAD.value}
VARIANTS = [
    *((mode, "ce", "bf16") for mode in MODES),
    *((mode, "all", "bf16") for mode in MODES),
    ("fused", "all", "fp32"),
    ("fused", "k1", "bf16"),
    ("grad", "cispo", "bf16"),
]
TERMS = {
    "ce": MINIMAL,
    "all": EVERYTHING,
    "k1": [{**term, "kl_estimator": "k1"} if term is _GRPO else term for term in EVERYTHING],
    "cispo": [
        {"kind": "grpo", "policy_loss": "cispo", "ratio": "sequence", "tis_cap": 2.0}
        if term is _GRPO
        else term
        for term in EVERYTHING
    ],
}


@pytest.mark.parametrize(("mode", "terms", "logits_type"), VARIANTS)
def test_row_kernel_compiles_for_sm90(mode: str, terms: str, logits_type: str) -> None:
    kernel_terms = _kernel_terms(TERMS[terms])
    constexprs = {
        "ROWS": kernel_terms.rows,
        "OPTIONS": kernel_terms.options,
        "ROW_VALUES": rows.ROW_VALUE_COLUMNS,
        "TEACHER": kernel_terms.teacher,
        "ARGMAX": kernel_terms.argmax,
        "MODE": MODES[mode],
        "BLOCK_V": 8192,
    }
    source = ASTSource(
        fn=rows.head_rows_kernel,
        signature=_row_kernel_signature(logits_type, kernel_terms),
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


@pytest.mark.parametrize(("operand_type", "out_type"), [("bf16", "fp32"), ("fp32", "bf16")])
def test_grouped_wgrad_kernel_compiles_for_sm90(operand_type: str, out_type: str) -> None:
    # bf16 into float32 (the experts' main_grad: tensor-core GEMM, atomic adds), and the
    # other branches: full-float32 products, a load-add-store into a bf16 out.
    from mtprun.kernels.triton import grouped_wgrad

    kernel = grouped_wgrad.grouped_wgrad_kernel
    pointers = {"a_ptr": f"*{operand_type}", "b_ptr": f"*{operand_type}", "ends_ptr": "*i32"}
    signature = _signature(kernel, pointers | {"out_ptr": f"*{out_type}"}, "*fp32")
    constexprs = {
        "TILES_M": 12,
        "TILES_N": 16,
        "BLOCK_M": grouped_wgrad.BLOCK_M,
        "BLOCK_N": grouped_wgrad.BLOCK_N,
        "BLOCK_K": grouped_wgrad.BLOCK_K,
        "PRECISION": "ieee" if operand_type == "fp32" else "tf32",
        "UPCAST": False,
        "ATOMIC": out_type == "fp32",
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": grouped_wgrad.NUM_WARPS, "num_stages": grouped_wgrad.NUM_STAGES}
    compiled = triton.compile(source, target=H100, options=options)
    assert compiled.asm["cubin"]
    if operand_type == "bf16":
        assert "wgmma" in compiled.asm["ptx"] and "red.global" in compiled.asm["ptx"]


@pytest.mark.parametrize("width", [128, 4096])
def test_rms_norm_kernels_compile_for_sm90(width: int) -> None:
    from mtprun.kernels.triton import rms_norm

    rows, block = rms_norm.block_shape(width)
    scalars = {"eps": "fp32"}
    for kernel in (rms_norm.rms_norm_forward_kernel, rms_norm.rms_norm_backward_kernel):
        pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "g_ptr": "*bf16", "dx_ptr": "*bf16"}
        signature = _signature(kernel, pointers, "*fp32", scalars)
        constexprs = {"ROWS": rows, "BLOCK": block}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        assert triton.compile(source, target=H100, options={"num_warps": 8}).asm["cubin"]
