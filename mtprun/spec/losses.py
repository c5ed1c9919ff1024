"""Loss-term configs: the items of a recipe's `losses:` list, a union discriminated on `kind`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]


class _Term(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1.0, ge=0, description="Multiplier of this term in the summed loss.")
    loss_agg: LossAgg = Field(
        "token-mean",
        description="How per-token values become one number: mean over the term's valid tokens "
        "(token-mean), mean over sequences of each sequence's token mean, or mean over sequences "
        "of the token sum divided by the longest sequence.",
    )


class CETerm(_Term):
    """Cross-entropy to the next token."""

    kind: Literal["ce"] = Field("ce", description="Term kind.")


class ZLossTerm(_Term):
    """lse^2 penalty that keeps the softmax normaliser near 1 (PaLM)."""

    kind: Literal["z_loss"] = Field("z_loss", description="Term kind.")
    weight: float = Field(1e-4, ge=0, description="Multiplier of lse^2 in the summed loss.")


class GRPOTerm(_Term):
    """PPO-clip policy gradient on group-normalised advantages, plus a KL to a reference."""

    kind: Literal["grpo"] = Field("grpo", description="Term kind.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio lower bound is 1 - clip_low.")
    clip_high: float = Field(0.28, gt=0, description="Ratio upper bound is 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    kl_estimator: KLEstimator = Field(
        "k3",
        description="KL estimator (Schulman): k1 log-ratio, k2 squared, k3 unbiased low-variance.",
    )


class EntropyTerm(BaseModel):
    """Entropy of the policy: always reported as a metric; a bonus -coef*H when coef > 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["entropy"] = Field("entropy", description="Term kind.")
    coef: float = Field(0.0, ge=0, description="Entropy bonus; 0 reports the metric only.")
    loss_agg: LossAgg = Field(
        "token-mean", description="How per-token entropies become one number."
    )

    @property
    def weight(self) -> float:
        return self.coef


class DistillTerm(_Term):
    """Soft cross-entropy (forward KL up to a constant) to a teacher's tempered distribution."""

    kind: Literal["distill"] = Field("distill", description="Term kind.")
    teacher: str = Field(..., description="HF folder of the teacher model.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of the teacher.")


class MTPTerm(_Term):
    """Draft loss of the multi-token-prediction heads; never reaches the policy trunk."""

    kind: Literal["mtp"] = Field("mtp", description="Term kind.")
    weight: float = Field(0.3, ge=0, description="Multiplier of the draft loss in the summed loss.")
    depth: int = Field(1, ge=1, description="Number of MTP heads trained (head k predicts t+k).")
    target: Literal["soft", "topk", "hard"] = Field(
        "soft",
        description="soft: the policy's detached distribution at t+k; topk: that restricted to "
        "its top-k tokens; hard: cross-entropy to the true token t+k.",
    )
    topk: int | None = Field(None, ge=1, description="k of target: topk.")
    train_shared_output: bool = Field(
        False, description="Let the draft loss update the shared output layer too."
    )
    separate_optimizer: bool = Field(
        False, description="Give the MTP head its own optimizer and grad clipping."
    )

    @model_validator(mode="after")
    def _topk_matches_target(self) -> MTPTerm:
        if self.target == "topk" and self.topk is None:
            raise ValueError("target 'topk' needs `topk: K` (for example topk: 20)")
        if self.target != "topk" and self.topk is not None:
            raise ValueError(f"`topk` is only used with target 'topk', not '{self.target}'")
        return self


LossTerm = Annotated[
    CETerm | ZLossTerm | GRPOTerm | EntropyTerm | DistillTerm | MTPTerm,
    Field(discriminator="kind"),
]
LOSS_KINDS: tuple[str, ...] = ("ce", "z_loss", "grpo", "entropy", "distill", "mtp")
