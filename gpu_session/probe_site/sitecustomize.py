"""Probe only (gpu_session, untracked): with MTPRUN_PROBE_OVERLAP=1 every process's megatron-core
DDP overlaps its gradient reduce-scatter with the backward (=2: and the parameter all-gather
with the next forward). Put this folder first on PYTHONPATH; spawned ranks import it too."""
import os

if os.environ.get("MTPRUN_PROBE_OVERLAP"):
    from megatron.core.distributed import distributed_data_parallel_config as _config

    _cls = _config.DistributedDataParallelConfig
    _post = _cls.__post_init__

    def _overlapped(self):
        self.overlap_grad_reduce = True
        self.overlap_param_gather = os.environ["MTPRUN_PROBE_OVERLAP"] == "2"
        _post(self)

    _cls.__post_init__ = _overlapped

    # megatron 0.16 asserts that every parameter of a bucket reported its gradient; mtprun's
    # embedding adds into main_grad and returns none: give DDP's hook megatron's dummy instead.
    from mtprun.runner.trainer import embedding_grad as _embedding

    _backward = _embedding.EmbeddingIntoMainGrad.backward

    def _with_dummy(ctx, grad):
        _backward(ctx, grad)
        weight = ctx.weight
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None, None
        weight.grad_added_to_main_grad = True
        return None, __import__("torch").empty_like(weight)

    _embedding.EmbeddingIntoMainGrad.backward = staticmethod(_with_dummy)

    # The output layer's gradient goes into its main_grad inside the head loss (on CUDA the
    # Triton engine's _PrecomputedGrads; run 90's probe patched the CPU engine's class): the same.
    import importlib

    _triton_head = importlib.import_module("mtprun.kernels.triton.head_loss")
    _precomputed = _triton_head._PrecomputedGrads
    _forward, _backward_head = _precomputed.forward, _precomputed.backward

    def _forward_keeping_weight(ctx, loss, grads, weight, *students):
        ctx.weight = weight
        return _forward(ctx, loss, grads, weight, *students)

    def _backward_with_dummy(ctx, grad_loss):
        out = list(_backward_head(ctx, grad_loss))
        weight = ctx.weight
        if out[2] is None and hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            out[2] = __import__("torch").empty_like(weight)
        return tuple(out)

    _precomputed.forward = staticmethod(_forward_keeping_weight)
    _precomputed.backward = staticmethod(_backward_with_dummy)
