"""`rollout:` the generation engine of RL tasks."""

from typing import Literal

from pydantic import Field

from mtprun.spec.base import Section


class SpeculativeSection(Section):
    """Speculative decoding of rollouts."""

    method: Literal["mtp"] = Field(
        "mtp", description="Draft with the model's own MTP layers (needs model.tiny.mtp_layers)."
    )
    num_speculative_tokens: int = Field(1, ge=1, description="Draft tokens per step.")


class RolloutSection(Section):
    """How the generation engine samples RL rollouts."""

    engine: Literal["vllm"] = Field("vllm", description="Generation engine.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int = Field(64, ge=1, description="Maximum new tokens per assistant turn.")
    ignore_eos: bool = Field(
        False,
        description="Sample past the end-of-sequence token, every response to max_tokens "
        "(throughput benchmarks; stop tokens of multi-turn tasks still end a turn).",
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO's over-long filtering: responses cut at max_tokens (an episode with "
        "a turn cut there) leave the loss, their tokens off the loss mask (still counted in "
        "response/truncated_frac and rollout/truncated_frac).",
    )
    speculative: SpeculativeSection | None = Field(
        None, description="Speculative decoding; null turns it off."
    )
    partial: bool = Field(
        False,
        description="Partial rollouts (with max_staleness >= 1 and recompute_logprobs): the "
        "engines generate in chunks of partial_chunk_tokens, and a weight update lands between "
        "two chunks instead of waiting for the step's longest response; unfinished responses "
        "keep their tokens and continue under the new weights. Every token records the policy "
        "version that sampled it; the trainer corrects with the engines' log-probs (a grpo "
        "term's tis_cap).",
    )
    partial_chunk_tokens: int = Field(
        256, ge=1, description="Partial rollouts: tokens a response grows between two pauses."
    )
    max_offpolicy_steps: int | None = Field(
        None,
        ge=0,
        description="Partial rollouts: a token sampled by a policy more than this many optimizer "
        "steps older than the one it trains leaves the loss mask (null: none is dropped).",
    )
    num_engines: int = Field(1, ge=1, description="Rollout engine replicas.")
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous rollouts: the engines generate the episodes of steps "
        "t+1..t+k while the trainer trains step t, so an episode is sampled by a policy up to k "
        "optimizer steps older than the one it trains (0: the synchronous loop).",
    )
    weight_transfer: Literal["auto", "collective", "cuda_ipc", "object_store"] = Field(
        "auto",
        description="How the trainer's weights reach the engines after each step: `collective` "
        "broadcasts them from trainer rank 0 over a process group (gloo on CPU, NCCL on GPUs); "
        "`cuda_ipc` lets each colocated engine copy them from its trainer rank's GPU memory "
        "(resources.placement: colocate); `object_store` passes them through Ray's object "
        "store. `auto`: cuda_ipc when colocated (object_store for LoRA adapters), else "
        "collective.",
    )
    cuda_graphs: bool = Field(
        True,
        description="On GPUs, capture CUDA graphs of the engines' decode steps (no "
        "torch.compile); false runs vLLM eagerly. CPU engines always run eagerly.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Share of its GPU's memory an engine's vLLM may take (weights, CUDA graphs, "
        "KV cache). null: 0.85 with resources.placement split; colocated, what the trainer "
        "leaves free when the engine starts, less 2 GiB.",
    )
    recompute_logprobs: bool = Field(
        False,
        description="Before each update the trainer recomputes the old log-probs of the "
        "sampled tokens with its own forward pass; the engine's become the sampler log-probs "
        "(train/logprob_mismatch, and a grpo term's tis_cap correction).",
    )
