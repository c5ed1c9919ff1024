"""The fused head-loss engine: `HeadInputs.build` checks the inputs once, `head_loss` runs
them (torch on CPU, Triton on CUDA)."""

from mtprun.kernels.head_loss import head_loss
from mtprun.kernels.inputs import HeadInputs
from mtprun.kernels.output import HeadLossOutput
from mtprun.kernels.torch_engine import Chunking

__all__ = ["Chunking", "HeadInputs", "HeadLossOutput", "head_loss"]
