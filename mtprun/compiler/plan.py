"""HeadPlan: the one fused head-kernel configuration compiled from a recipe's loss terms."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from mtprun import losses
from mtprun.losses import LossTerm, Stat, sampler

_TERMS = TypeAdapter(list[LossTerm])


@dataclass(frozen=True)
class HeadPlan:
    """Immutable, JSON-serialisable description of the fused head loss.

    terms:        the loss terms with their coefficients, in recipe order.
    stats:        union of the per-row statistics the terms need (one vocab pass computes all).
    metrics:      every metric name the kernel emits ("entropy" always first).
    compact_mask: drop rows outside the loss mask before any vocab work.
    mtp_depths:   the MTP heads (1..D) whose rows are taught by policy rows t+k.
    tp_size:      tensor-parallel size (the vocab is split in tp_size shards).
    sampler_logprobs: the head loss takes the rollout engine's log-probs besides the trainer's
                  old ones (rollout.recompute_logprobs, a grpo tis_cap) and reports their
                  mismatch.
    norm_length:  the constant L of `loss_agg: seq-mean-token-sum-norm` (Dr. GRPO's
                  generation budget); None: the longest packed sequence of each call.
    """

    terms: tuple[LossTerm, ...]
    stats: tuple[Stat, ...] = field(default=())
    metrics: tuple[str, ...] = field(default=())
    compact_mask: bool = True
    mtp_depths: tuple[int, ...] = ()
    tp_size: int = 1
    sampler_logprobs: bool = False
    norm_length: int | None = None

    @classmethod
    def compile(
        cls,
        terms: Iterable[LossTerm],
        *,
        tp_size: int = 1,
        compact_mask: bool = True,
        sampler_logprobs: bool = False,
        norm_length: int | None = None,
    ) -> HeadPlan:
        terms = tuple(terms)
        if not terms:
            raise ValueError("a HeadPlan needs at least one loss term")
        if norm_length is not None and norm_length < 1:
            raise ValueError(f"norm_length must be a positive token count, got {norm_length}")
        grpo = next((t for t in terms if t.kind == "grpo"), None)
        tis_cap = None if grpo is None else grpo.tis_cap
        sampler_logprobs = sampler_logprobs or tis_cap is not None
        needed = {Stat.LSE, Stat.EXPECTED_LOGIT}  # entropy is always reported
        metrics = ["entropy"]
        for term in terms:
            needed |= losses.needs(term)
            metrics += [m for m in losses.metric_names(term) if m not in metrics]
        if sampler_logprobs:
            metrics += sampler.metric_names(tis_cap)
        depths = max((t.depth for t in terms if t.kind == "mtp"), default=0)
        return cls(
            terms=terms,
            stats=tuple(s for s in Stat if s in needed),
            metrics=tuple(metrics),
            compact_mask=compact_mask,
            mtp_depths=tuple(range(1, depths + 1)),
            tp_size=tp_size,
            sampler_logprobs=sampler_logprobs,
            norm_length=norm_length,
        )

    @classmethod
    def from_losses(cls, terms: Sequence[Mapping[str, Any]], **options: Any) -> HeadPlan:
        """Build from the same dicts a recipe's `losses:` list holds."""
        return cls.compile(_TERMS.validate_python(list(terms)), **options)

    def term(self, kind: str) -> LossTerm | None:
        """The first term of `kind`, or None."""
        return next((t for t in self.terms if t.kind == kind), None)

    @property
    def mtp_depth(self) -> int:
        """How many MTP layers the mtp term trains (heads 1..D; 0 without the term)."""
        return max(self.mtp_depths, default=0)

    @property
    def sequence_ratio(self) -> bool:
        """A term needs a per-sequence reduction of the rows' log-probs before its gradient
        (GSPO): the engines then take every policy row's statistics before any gradient."""
        grpo = self.term("grpo")
        return grpo is not None and grpo.ratio == "sequence"

    def to_dict(self) -> dict[str, Any]:
        return {
            "terms": [t.model_dump(mode="json") for t in self.terms],
            "stats": [str(s) for s in self.stats],
            "metrics": list(self.metrics),
            "compact_mask": self.compact_mask,
            "mtp_depths": list(self.mtp_depths),
            "tp_size": self.tp_size,
            "sampler_logprobs": self.sampler_logprobs,
            "norm_length": self.norm_length,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HeadPlan:
        data = json.loads(text)
        return cls(
            terms=tuple(_TERMS.validate_python(data["terms"])),
            stats=tuple(Stat(s) for s in data["stats"]),
            metrics=tuple(data["metrics"]),
            compact_mask=data["compact_mask"],
            mtp_depths=tuple(data["mtp_depths"]),
            tp_size=data["tp_size"],
            sampler_logprobs=data.get("sampler_logprobs", False),
            norm_length=data.get("norm_length"),
        )

    @property
    def hash(self) -> str:
        """Stable short hash of the plan (canonical JSON, sorted keys)."""
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()[:16]
