"""GPU path of the fused head loss: cuBLAS GEMMs per row chunk around one Triton kernel.

`mtprun.kernels.head_loss` dispatches CUDA tensors here; under `TRITON_INTERPRET=1` the same
code runs on CPU tensors (how CI tests it).
"""

from mtprun.kernels.triton.head_loss import triton_head_loss

__all__ = ["triton_head_loss"]
