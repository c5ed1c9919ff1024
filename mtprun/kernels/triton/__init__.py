"""GPU path of the fused head loss: cuBLAS GEMMs per row chunk around one Triton kernel.

`mtprun.kernels.head_loss` dispatches CUDA tensors here; under `TRITON_INTERPRET=1` the same
code runs on CPU tensors (how CI tests it).
"""

from mtprun.kernels.triton.head_loss import head_loss_triton

__all__ = ["head_loss_triton"]
