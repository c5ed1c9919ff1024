"""The rollout engine: vLLM in-process, sampling token ids with their log-probs.

The engine runs inside the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), which starts
several times faster than vLLM's engine-core subprocess and lets weight syncs pass tensors by
reference. That process must not hold a torch.distributed group (vLLM makes its own and
destroys it at shutdown), so trainers and engines live in separate processes. Weight sync
goes through vLLM's in-place `reload_weights`, for the policy and, with MTP speculative
decoding, for the drafter, which holds its own copy; on CPU, MoE experts are then prepacked
again (`_prepack_cpu_experts`).

Router replay's routing capture is `routing_capture`'s, LoRA serving `engine_lora`'s. A family
whose export vLLM serves with more than its folder (classes to register, config overrides,
engine arguments, a dtype) says so in its folder (`mtprun.models.family.VllmServing`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtprun.models.families import FAMILIES, family_of_config
from mtprun.models.family import VllmServing
from mtprun.runner.rollout.engine_lora import (
    PEFT_MATRICES,
    install_adapter,
    lora_engine_args,
    lora_rollout_problem,
    vllm_max_lora_rank,
)
from mtprun.runner.rollout.part_feed import PartFeed
from mtprun.runner.rollout.routing_capture import (
    bind_cpu_capture,
    routed_experts_problem,
    take_capture,
)
from mtprun.runner.rollout.vllm_compat import draft_model, gpu_engine_args, reload_in_place
from mtprun.runner.rollout.vllm_registry import inspect_models_in_process
from mtprun.runner.usage_reporting import disable_usage_reporting
from mtprun.spec.model import LoRASection
from mtprun.spec.rollout import RolloutSection

_SPEC_DECODE_PREFIX = "vllm:spec_decode_"

# Imported by callers from here too.
__all__ = [
    "DEFAULT_SAMPLING",
    "RolloutEngine",
    "Sample",
    "Sampling",
    "configure_vllm_env",
    "lora_rollout_problem",
    "routed_experts_problem",
    "served_dtype",
    "spec_decode_metrics",
    "vllm_config_overrides",
    "vllm_max_lora_rank",
]


@dataclass
class Sample:
    """One completion: sampled token ids, the log-prob of each, and why it stopped
    ("stop": an end-of-sequence or stop token, included in token_ids; "length": max_tokens)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int  # the policy version that sampled it (the global step of its weights)
    # With router replay: [R, layers, top k] experts the engine routed each token of the
    # prompt and the completion to, from the prompt's first token (R: every token but the
    # last sampled one, which no forward pass read); else None.
    routed_experts: Any = None
    # Partial rollouts: the policy version of each token (a response continued across a
    # weight update; `version` is then its first, oldest, one); None: all `version`.
    token_versions: list[int] | None = None

    def versions(self) -> list[int]:
        """The policy version that sampled each token."""
        if self.token_versions is not None:
            return self.token_versions
        return [self.version] * len(self.token_ids)


def configure_vllm_env(work_dir: Path) -> None:
    """Environment vLLM reads at import/engine start (docs/stack.md): in-process engine, no
    torch.compile, offline hub, no usage reports, PyTorch's top-k/top-p sampling. Explicit
    settings win, except the in-process engine, which this class relies on.

    vLLM's cache stays where vLLM keeps it (`VLLM_CACHE_ROOT`, ~/.cache/vllm by default),
    shared by runs: it holds what vLLM learns of a model class by importing it in a
    subprocess (~13 s on a 2-core machine, keyed by the class's source), which a cache per run
    folder paid at every engine start. `work_dir` is the engine's own folder."""
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    if os.environ["TORCH_COMPILE_DISABLE"] == "1":
        # torch reads the variable once, at import: apply it when torch came first.
        torch._dynamo.config.disable = True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    disable_usage_reporting()  # an engine on a cluster's node has not the driver's environment
    # vLLM's CUDA warm-up samples through FlashInfer, whose sampling kernels are compiled
    # (nvcc) at their first use on a machine: an engine start on a fresh GPU machine waited
    # minutes for it (issue 34's run 77). Rollouts sample at plain temperature, where the
    # samplers do the same work; an evaluation's top_p runs in PyTorch's.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB


def _serving(model_dir: Path) -> tuple[dict[str, Any], VllmServing]:
    """The folder's config.json and how its family is served (the defaults for an
    architecture no family reads)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    family = family_of_config(config)
    return config, family.vllm if family is not None else VllmServing()


def register_vllm_models() -> None:
    """Every family's model classes that vLLM takes from mtprun (`VllmServing.register`); on
    CPU machines, vLLM's inspection of model classes in this process (`vllm_registry`)."""
    for serving in {id(f.vllm): f.vllm for f in FAMILIES}.values():
        serving.register()
    if not torch.cuda.is_available():
        inspect_models_in_process()


def served_dtype(model_dir: Path, trainer_dtype: str | None = None) -> str:
    """The dtype the engine serves in: the trainer's (`model.dtype`, so that sampled and
    trained log-probs agree) where given, else the one config.json declares (vLLM's "auto"
    would run float32 checkpoints in bfloat16 on CPU). Except where the family serves in
    another (`VllmServing.dtype`: Qwen3.5's Gated DeltaNet layers on vLLM-cpu run bfloat16
    only)."""
    config, serving = _serving(model_dir)
    served = serving.dtype(config, torch.cuda.is_available())
    declared = config.get("dtype") or config.get("torch_dtype") or "auto"
    return served or trainer_dtype or str(declared)


def vllm_config_overrides(model_dir: Path) -> dict[str, Any] | None:
    """config.json values vLLM needs and the folder leaves to a default (`hf_overrides`:
    `VllmServing.hf_overrides`, e.g. GLM-4.5's `head_dim`)."""
    config, serving = _serving(model_dir)
    return serving.hf_overrides(config)


def family_engine_args(model_dir: Path, speculative: bool) -> dict[str, Any]:
    """vLLM engine arguments the folder's family needs (`VllmServing.engine_args`)."""
    config, serving = _serving(model_dir)
    return serving.engine_args(config, speculative, torch.cuda.is_available())


def _reload_drafter(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside the vLLM worker: reload the speculative drafter's weights in place."""
    runner = worker.model_runner
    reload_in_place(runner, draft_model(runner), weights)


def _prepack_cpu_experts(worker: Any) -> int:
    """Runs inside the vLLM worker after an in-place reload: put the CPU MoE experts' weights
    back into the layout their kernel reads; returns how many layers it repacked.

    vLLM 0.32's CPU experts (`CPUUnquantizedExperts` and its x86/Arm/Power kinds) prepack
    w13/w2 into their grouped-GEMM layout in `process_weights_after_loading` of the experts
    kernel, which `UnquantizedFusedMoEMethod._setup_kernel` calls only on the first load: a
    reload (a weight update, `moe_kernel` already set) copies the checkpoint-layout weights
    into the prepacked tensors and skips the prepack, so the kernel then reads unpacked weights
    (log-probs off by ~1e-2 on a tiny Qwen3-MoE, greedy tokens diverging). This runs the same
    prepack, vLLM's own, on the freshly reloaded weights. GPU experts have no such step."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    runner = worker.model_runner
    models = [runner.model]
    if (drafter := draft_model(runner)) is not None:
        models.append(drafter)
    repacked = 0
    for model in models:
        for layer in model.modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(layer)
                repacked += 1
    return repacked


def _gpu_args(rollout: RolloutSection, colocate: bool) -> dict[str, Any]:
    return gpu_engine_args(
        cuda_graphs=rollout.cuda_graphs,
        colocate=colocate,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
    )


def _speculative_config(rollout: RolloutSection) -> dict[str, Any] | None:
    if rollout.speculative is None:
        return None
    return {
        "method": rollout.speculative.method,
        "num_speculative_tokens": rollout.speculative.num_speculative_tokens,
    }


def _routing_args(capture: bool, routed_experts: bool) -> dict[str, Any]:
    """Router replay: vLLM-cpu's routing is captured per request (no prefix cache hiding a
    prompt's forward pass), vLLM's own returns it on GPUs."""
    if capture:
        return {"enable_prefix_caching": False}
    return {"enable_return_routed_experts": True} if routed_experts else {}


@dataclass(frozen=True)
class Sampling:
    """One generate call's sampling: overrides of the rollout section (None: the section's
    value) and the tokens that end a turn."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] | None = None


DEFAULT_SAMPLING = Sampling()  # the rollout section's sampling, no stop tokens


class RolloutEngine:
    """vLLM engine over an HF model folder; `generate` takes and returns token ids."""

    def __init__(
        self,
        model_dir: Path,
        rollout: RolloutSection,
        seed: int,
        work_dir: Path,
        version: int = 0,
        routed_experts: bool = False,
        lora: LoRASection | None = None,
        colocate: bool = False,
        engine_args: dict[str, Any] | None = None,
        dtype: str | None = None,
    ):
        """`engine_args`: vLLM engine arguments over mtprun's (benchmarks: `load_format:
        dummy` serves a shape without reading its weights). `dtype`: the trainer's
        (`model.dtype`); None: the folder's (`served_dtype`)."""
        if torch.distributed.is_initialized():
            # vLLM would join that group as its own world and destroy it at shutdown.
            raise RuntimeError(
                "RolloutEngine needs a process without a torch.distributed group (the trainer's "
                "is already initialised here); run the engine in its own process or Ray actor"
            )
        configure_vllm_env(work_dir)
        from vllm import LLM

        register_vllm_models()  # e.g. Qwen3.5's on vLLM-cpu without torchvision

        self.rollout = rollout
        # Colocated beside a trainer rank: sleeps while it trains (see `sleep`).
        self.colocate = colocate and torch.cuda.is_available()
        self._asleep: list[str] = []  # vLLM sleep-mode tags released and not woken yet
        self._sleep_level = 0
        # Seconds inside vLLM's generate and the tokens it sampled, since the last take.
        self._generated: tuple[float, int] = (0.0, 0)
        self.version = version  # of the weights it holds: the global step that made them
        # An update fed in parts (`begin_update`): its feed and version, and when it began.
        self._feed: tuple[PartFeed, int] | None = None
        self._update_start = 0.0
        self._partial = False  # an update began and did not complete: mixed weights
        self.lora = lora
        # With LoRA: the adapter every generate names; None until the first sync.
        self.adapter: Any = None
        self._adapters_installed = 0  # each install takes a new id (vLLM caches by id)
        # Router replay: return each sample's routing, vLLM's own (GPU) or captured (CPU).
        self.routed_experts = routed_experts
        self._capture = routed_experts and not torch.cuda.is_available()
        if routed_experts and (problem := routed_experts_problem(rollout)) is not None:
            raise ValueError(f"trainer.router_replay: {problem}")
        if lora is not None and (problem := lora_rollout_problem(Path(model_dir))) is not None:
            raise ValueError(f"model.lora: {problem}")
        speculative = _speculative_config(rollout)
        args: dict[str, Any] = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "dtype": served_dtype(Path(model_dir), dtype),
            "hf_overrides": vllm_config_overrides(Path(model_dir)),
            "seed": seed,
            "speculative_config": speculative,
            "disable_log_stats": speculative is None,  # spec-decode counters need stats on
            "enforce_eager": True,  # CPU; on GPUs _gpu_args says
            **_gpu_args(rollout, self.colocate),
            **_routing_args(self._capture, routed_experts),
            # e.g. a hybrid model drafting on vLLM-cpu needs prefix caching off (Qwen3.5's).
            **family_engine_args(Path(model_dir), speculative is not None),
            **(lora_engine_args(lora) if lora is not None else {}),
            **(engine_args or {}),
        }
        self.llm = LLM(**args)
        if self._capture:
            (bound,) = self.llm.collective_rpc(bind_cpu_capture)
            if not bound:
                raise ValueError(
                    f"trainer.router_replay: vLLM serves {model_dir} with no MoE router to "
                    "capture the routing of (a dense model?)"
                )

    def generate(
        self, prompts: list[list[int]], n: int, sampling: Sampling = DEFAULT_SAMPLING
    ) -> list[list[Sample]]:
        """n samples for each prompt (token ids), with the rollout section's sampling where
        `sampling` leaves a value None."""
        from vllm import SamplingParams, TokensPrompt

        if n < 1:
            raise ValueError(f"n={n}: ask for at least one sample per prompt")
        if self._partial:
            raise RuntimeError(
                "this engine's last weight update did not complete (its sender failed): it "
                "holds a mix of two policies and generates again after a complete update"
            )
        self.wake_up()  # a colocated engine that slept with its weights (LoRA's base)
        # vLLM refuses n > 1 with greedy sampling; greedy copies are identical anyway.
        temperature = self.rollout.temperature
        temperature = temperature if sampling.temperature is None else sampling.temperature
        copies = n if temperature == 0 else 1
        params = SamplingParams(
            n=n // copies,
            temperature=temperature,
            top_p=self.rollout.top_p if sampling.top_p is None else sampling.top_p,
            max_tokens=sampling.max_tokens or self.rollout.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids or ()) or None,
            ignore_eos=self.rollout.ignore_eos,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,  # token ids in, token ids out: the renderer decodes
        )
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(copies)]
        start = time.perf_counter()
        if self._capture:
            samples = self._generate_captured(requests, params)
        else:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.adapter)
            samples = [_sample(c, self.version) for out in outputs for c in out.outputs]
        seconds, tokens = self._generated
        self._generated = (
            seconds + time.perf_counter() - start,
            tokens + sum(len(s.token_ids) for s in samples),
        )
        if self.routed_experts and any(s.routed_experts is None for s in samples):
            raise RuntimeError("router replay: vLLM returned a completion without its routing")
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def take_generated(self) -> tuple[float, int]:
        """Seconds inside vLLM's generate and tokens sampled since the previous take."""
        taken, self._generated = self._generated, (0.0, 0)
        return taken

    def _generate_captured(self, requests: list[Any], params: Any) -> list[Sample]:
        """vLLM-cpu with router replay: one request, one sample at a time, each one's routing
        captured from the forward passes it alone ran (see `routing_capture`)."""
        single = params.clone()
        single.n = 1
        samples = []
        for request in requests:
            for _ in range(params.n):
                self.llm.collective_rpc(take_capture)  # nothing of another request's
                (out,) = self.llm.generate(
                    [request], single, use_tqdm=False, lora_request=self.adapter
                )
                (routed,) = self.llm.collective_rpc(take_capture)
                sample = _sample(out.outputs[0], self.version)
                sample.routed_experts = routed
                samples.append(sample)
        return samples

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Load HF-named tensors, policy `version`, into the engine (and its MTP drafter), or
        with LoRA the PEFT-named adapters (the base stays); returns seconds. The policy alone
        loads them as `named` yields them (a transfer's buckets one at a time, never the
        whole model held twice); adapters and a drafter, which read them again, take a list."""
        detached = ((name, t.detach()) for name, t in named)
        if self.lora is None and self.rollout.speculative is None:
            return self._update(lambda: detached, version)
        return self._update(lambda: list(detached), version)

    def begin_update(self, version: int) -> None:
        """Start an update to policy `version` fed in parts: `load_part` (or `load_ipc_part`)
        for each, then `finish_update`. The policy reads each part as it comes, so the engine
        holds one part besides its weights; adapters and a drafter, which read the tensors
        again, load them all at the end."""
        if self._feed is not None:
            raise RuntimeError("a weight update is under way on this engine: finish or abort it")
        self._update_start = time.perf_counter()
        self._wake_weights()
        load = self._install if self.lora is not None else self._reload
        streamed = self.lora is None and self.rollout.speculative is None
        self._feed = (PartFeed(load, streamed), version)

    def load_part(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One part of the update `begin_update` started; returns once vLLM has read it."""
        if self._feed is None:
            raise RuntimeError("load_part without begin_update: no weight update is under way")
        self._feed[0].feed(named)

    def load_ipc_part(self, shared: Any) -> None:
        """One part from CUDA IPC handles of a trainer rank's buckets (`cuda_ipc.WeightHandles`),
        copied out of them at once: on return the trainer may free them."""
        from mtprun.runner.cuda_ipc import open_weights

        part = [(name, t.clone()) for name, t in open_weights(shared)]
        torch.cuda.synchronize()  # the copies have run before the trainer frees the buckets
        self.load_part(part)

    def finish_update(self) -> float:
        """End the update `begin_update` started; returns its seconds. A sleeping colocated
        engine's KV cache stays asleep until `wake_up` (after the trainer freed its buckets)."""
        if self._feed is None:
            raise RuntimeError("finish_update without begin_update: no weight update is under way")
        (feed, version), self._feed = self._feed, None
        feed.finish()
        self._loaded(version, wake_cache=False)
        return time.perf_counter() - self._update_start

    def abort_update(self) -> None:
        """Give up the update under way (its sender failed): the engine refuses to generate
        until a complete update has loaded."""
        if self._feed is not None:
            (feed, _), self._feed = self._feed, None
            feed.abort()

    def _update(self, weights: Any, version: int) -> float:
        """`weights()` into the engine. A sleeping colocated engine wakes its weights first
        (and its KV cache after the load)."""
        start = time.perf_counter()
        self._wake_weights()
        loaded = weights()
        if self.lora is not None:
            self._install(loaded)
        else:
            self._reload(loaded)
        del loaded
        self._loaded(version, wake_cache=True)
        return time.perf_counter() - start

    def _wake_weights(self) -> None:
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.remove("weights")

    def _loaded(self, version: int, wake_cache: bool) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # every copy out of the sender's tensors has run
        self.version = version
        self._partial = False
        if wake_cache:
            self.wake_up()
        self.llm.reset_prefix_cache()

    @property
    def asleep(self) -> bool:
        return bool(self._asleep)

    def sleep(self) -> float:
        """Colocated: release the GPU for the trainer's step; returns seconds. The KV cache
        is dropped; so are the weights (level 2) when the next sync brings all of them, while
        with LoRA the frozen base moves to the host and back (level 1)."""
        if not self.colocate or self.asleep:
            return 0.0
        start = time.perf_counter()
        self._sleep_level = 1 if self.lora is not None else 2
        self.llm.sleep(level=self._sleep_level)
        self._asleep = ["weights", "kv_cache"]
        return time.perf_counter() - start

    def wake_up(self) -> float:
        """Wake what still sleeps: the KV cache after a sync, or everything with the weights
        kept (LoRA's base, level 1); returns seconds. Weights a level-2 sleep discarded come
        back with a weight sync only."""
        if not self.asleep:
            return 0.0
        if "weights" in self._asleep and self._sleep_level == 2:
            raise RuntimeError(
                "the colocated engine slept without its weights (level 2): a weight sync wakes "
                "it (update_weights, or begin_update ... finish_update)"
            )
        start = time.perf_counter()
        self.llm.wake_up(tags=self._asleep)
        self._asleep = []
        return time.perf_counter() - start

    def _install(self, adapters: list[tuple[str, torch.Tensor]]) -> None:
        """The trainer's adapters become the one every generate uses."""
        from vllm.lora.request import LoRARequest

        assert self.lora is not None
        others = [name for name, _ in adapters if not any(m in name for m in PEFT_MATRICES)]
        if others or not adapters:
            raise ValueError(
                "model.lora: the engine serves the base with adapters and takes LoRA adapter "
                f"tensors only; got {others[:3] or 'none'}"
            )
        config = {
            "r": self.lora.rank,
            "lora_alpha": self.lora.lora_alpha,
            "target_modules": list(self.lora.modules),
        }
        lora_id = self._adapters_installed + 1
        self.llm.collective_rpc(install_adapter, args=(dict(adapters), config, lora_id))
        self._adapters_installed = lora_id
        # The path is never read: the worker holds this id already (an unknown id would be
        # loaded from it, and fail).
        self.adapter = LoRARequest(f"policy-{lora_id}", lora_id, lora_path="in-memory")

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full HF-named weights into the policy in place (and its MTP drafter)."""
        self._partial = True  # until the load completes: a failed one leaves a mixed model
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.rollout.speculative is not None:
            self.llm.collective_rpc(_reload_drafter, args=(weights,))
        if not torch.cuda.is_available():
            self.llm.collective_rpc(_prepack_cpu_experts)

    def spec_decode_counters(self) -> dict[str, float]:
        """vLLM's cumulative speculative-decoding counters (difference them per step):
        num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos/{i}.
        Empty without speculative decoding (the engine then keeps no statistics)."""
        if self.rollout.speculative is None:
            return {}
        counters: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            if not metric.name.startswith(_SPEC_DECODE_PREFIX):
                continue
            name = metric.name.removeprefix(_SPEC_DECODE_PREFIX)
            if hasattr(metric, "values"):
                counters.update({f"{name}/{i}": float(v) for i, v in enumerate(metric.values)})
            else:
                counters[name] = float(metric.value)
        return counters

    def shutdown(self) -> None:
        """Free the engine; the object is unusable afterwards."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm


def spec_decode_metrics(delta: dict[str, float]) -> dict[str, float]:
    """Acceptance metrics from differences of `spec_decode_counters` over one step.

    accept_rate: accepted / drafted tokens; accept_rate/pos{i}: share of drafts whose draft
    token i was accepted; mean_accepted_len: tokens a sequence gains per engine step (the
    target's own token plus the accepted drafts, so 1 without any acceptance). Empty when
    nothing was drafted (no decoding, or an engine restarted and its counters reset).
    """
    drafts, drafted = delta.get("num_drafts", 0.0), delta.get("num_draft_tokens", 0.0)
    if drafts <= 0 or drafted <= 0:
        return {}
    accepted = delta.get("num_accepted_tokens", 0.0)
    metrics = {
        "rollout/spec_accept_rate": accepted / drafted,
        "rollout/spec_mean_accepted_len": 1.0 + accepted / drafts,
        "rollout/spec_drafts": drafts,
    }
    positions = sorted(
        (int(k.rsplit("/", 1)[1]), v)
        for k, v in delta.items()
        if k.startswith("num_accepted_tokens_per_pos/")
    )
    metrics.update({f"rollout/spec_accept_rate/pos{i}": v / drafts for i, v in positions})
    return metrics


def _sample(completion: Any, version: int) -> Sample:
    token_ids = list(completion.token_ids)
    logprobs = [step[tok].logprob for tok, step in zip(token_ids, completion.logprobs, strict=True)]
    routed = getattr(completion, "routed_experts", None)
    return Sample(token_ids, logprobs, completion.finish_reason or "length", version, routed)
