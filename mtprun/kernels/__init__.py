"""The fused head-loss engine: `head_loss` (torch on CPU, Triton on CUDA)."""

from mtprun.kernels.head_loss import head_loss
from mtprun.kernels.output import HeadLossOutput
from mtprun.kernels.torch_engine import Chunking

__all__ = ["Chunking", "HeadLossOutput", "head_loss"]
