"""Loss-term configs: the items of a recipe's `losses:` list, a union discriminated on `kind`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
PolicyLoss = Literal["clip", "cispo"]
RatioLevel = Literal["token", "sequence"]


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
    """Policy gradient on group-normalised advantages (PPO-clip, GSPO, CISPO, dual-clip, with a
    truncated importance-sampling correction), plus a KL to a reference.

    Formulas: mtprun/losses/grpo.py and the README (Library: policy-loss variants).
    """

    kind: Literal["grpo"] = Field("grpo", description="Term kind.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio lower bound is 1 - clip_low.")
    clip_high: float = Field(
        0.28,
        gt=0,
        description="Ratio upper bound is 1 + clip_high (cispo: the cap of its IS weight).",
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    kl_estimator: KLEstimator = Field(
        "k3",
        description="KL estimator (Schulman): k1 log-ratio, k2 squared, k3 unbiased low-variance.",
    )
    policy_loss: PolicyLoss = Field(
        "clip",
        description="clip: PPO's -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); cispo "
        "(MiniMax-M1): -sg(min(r, 1 + clip_high)) A logp, a clipped stop-gradient IS weight, "
        "so every token keeps its gradient.",
    )
    ratio: RatioLevel = Field(
        "token",
        description="token: r = exp(logp - old_logp) per token; sequence (GSPO): one r per "
        "sequence, exp of the mean of logp - old_logp over its trained tokens, clipped per "
        "sequence, its gradient reaching every token (GSPO uses clip ranges near 4e-4).",
    )
    clip_c: float | None = Field(
        None,
        gt=1,
        description="Dual-clip PPO: where A < 0 the surrogate is max(min(r A, clip(r) A), "
        "clip_c A), bounding what one token with a huge ratio can cost; null turns it off.",
    )
    tis_cap: float | None = Field(
        None,
        ge=1,
        description="Truncated importance sampling: the policy-gradient part of each token is "
        "weighted by min(pi_old / pi_sampler, tis_cap), pi_old the trainer's recomputed "
        "old policy, pi_sampler the rollout engine's (needs rollout.recompute_logprobs; "
        "at least 1, typically 2); null turns it off.",
    )

    @model_validator(mode="after")
    def _options_fit_the_policy_loss(self) -> GRPOTerm:
        if self.policy_loss == "cispo" and self.clip_c is not None:
            raise ValueError(
                "`clip_c` (dual-clip) bounds PPO's clipped surrogate and has no effect with "
                "policy_loss 'cispo': remove clip_c or use policy_loss: clip"
            )
        if self.policy_loss == "cispo" and "clip_low" in self.model_fields_set:
            raise ValueError(
                "policy_loss 'cispo' caps its IS weight at 1 + clip_high only: remove "
                "`clip_low` (it has no lower bound)"
            )
        return self


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
