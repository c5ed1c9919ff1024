"""`trainer:` optimizer, schedule and step budget."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from mtprun.spec.base import Section


class TrainerSection(Section):
    """Optimizer, learning-rate schedule and step budget."""

    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    optimizer_state: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "dtype of AdamW's two moments (exp_avg, exp_avg_sq) when the weights train in "
            "bf16 (model.dtype: bfloat16 on GPUs, megatron-core's distributed optimizer): "
            "float32 keeps 8 bytes per parameter, bfloat16 4 (stochastically rounded, so "
            "that their running averages stay unbiased; the update still computes in float32 "
            "from float32 master weights and gradients). bfloat16 is how Qwen3-8B at tp 2 "
            "fits 80 GB GPUs. float32 weights (CPU, mtp.separate_optimizer) keep float32."
        ),
    )
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate decay after warm-up."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to `lr`.")
    steps: int = Field(100, ge=1, description="Optimizer steps (RL steps for a task).")
    micro_batch_tokens: int = Field(
        2048, ge=1, description="Tokens per packed micro batch (one forward/backward)."
    )
    balance: bool = Field(
        True,
        description=(
            "Balance each RL step's sequences across data-parallel replicas: split them into "
            "parallel.dp groups of near-equal compute (cost L * (a + L) per sequence of L "
            "tokens, a from the model's shape: linear FLOPs plus attention's quadratic term; "
            "Karmarkar-Karp), then pack each group first-fit decreasing into micro batches of "
            "at most micro_batch_tokens, the same number per replica where the sequences "
            "allow. The loss and gradient do not change (token-weighted over the step); no "
            "replica waits on another. false packs the sequences in rollout order and deals "
            "the micro batches round-robin. Nothing to balance with one replica."
        ),
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description=(
            "Activation recomputation in backward: none keeps every activation; selective "
            "recomputes each layer's MLP (its FFN activations are the largest); full keeps "
            "only each decoder layer's input and recomputes the layer (least memory, ~1/3 "
            "more compute)."
        ),
    )
    router_replay: bool = Field(
        False,
        description=(
            "Router replay (R3) for RL on a mixture-of-experts policy: every forward pass of "
            "the policy over rollout tokens (old and reference log-probs, the training step) "
            "routes each token to the experts the rollout engine routed it to, layer by "
            "layer, instead of choosing them again; the router's probabilities are still "
            "the trainer's, over those experts. Tokens whose engine routing is unknown (the "
            "last token of a trajectory, tokens inserted after the last sampled turn) route "
            "as usual, and so does SFT. Needs a task and an MoE policy, and a rollout engine "
            "that returns its routing (vLLM: Model Runner V2, enable_return_routed_experts)."
        ),
    )
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this value; null disables."
    )
    checkpoint_every: int | None = Field(
        None, ge=1, description="Save a checkpoint every N steps; null saves only at the end."
    )
    keep_checkpoints: int | None = Field(
        None,
        ge=1,
        description=(
            "Keep only the newest N checkpoints (each holds the optimizer state and an HF "
            "copy of the policy); stage ends are always kept. Null keeps every checkpoint."
        ),
    )
    max_restarts: int = Field(
        2,
        ge=0,
        description=(
            "Trainer restarts per attempt: when a trainer rank's process dies (OOM kill, lost "
            "node) the trainer starts again from the newest checkpoint and the steps after it "
            "run again; past this many the run fails."
        ),
    )

    @field_validator("optimizer_state")
    @classmethod
    def _state_of_adamw(cls, value: str, info: ValidationInfo) -> str:
        optimizer = info.data.get("optimizer", "adamw")  # validated first (declared first)
        if value != "float32" and optimizer != "adamw":
            raise ValueError(
                f"{value} sets the dtype of AdamW's moments, and optimizer {optimizer} keeps "
                "none (SGD without momentum): drop optimizer_state or use optimizer: adamw"
            )
        return value
