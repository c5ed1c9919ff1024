"""From per-row statistics to the loss, the metrics and the gradient coefficients of a row
group (backend-neutral: the Triton path reuses it once it has the statistics).

Everything here is a sum over rows, so it may run on all rows of a group at once or chunk by
chunk, the results adding up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mtprun import losses
from mtprun.kernels.inputs import HeadInputs
from mtprun.kernels.row_groups import RowGroup, aggregation_weights
from mtprun.losses import GradCoeffs, RowInputs, RowStats, grpo, sampler


@dataclass(frozen=True)
class GroupWeights:
    """[R] float32 row weights of a group: per term, sum(w * value) is the term's aggregated
    value (its `loss_agg`); `token_mean` averages a metric over the group's valid rows."""

    terms: tuple[torch.Tensor, ...]
    token_mean: torch.Tensor

    @classmethod
    def of(cls, group: RowGroup, inputs: HeadInputs) -> GroupWeights:
        def weights(loss_agg: str) -> torch.Tensor:
            return aggregation_weights(
                loss_agg, group, inputs.cu_seqlens, inputs.norm_length, inputs.tokens_per_sequence
            )

        return cls(
            terms=tuple(weights(t.loss_agg) for t in group.terms),
            token_mean=weights("token-mean"),
        )

    def select(self, rows: slice) -> GroupWeights:
        return GroupWeights(tuple(w[rows] for w in self.terms), self.token_mean[rows])


@dataclass
class GroupResult:
    """A group's (or chunk's) contribution: loss, metric sums and gradient coefficients."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    grad: GradCoeffs


def row_inputs(group: RowGroup, inputs: HeadInputs) -> RowInputs:
    """The group's per-token inputs (policy rows only: the MTP terms take none)."""
    if group.head:
        return RowInputs()

    def pick(value: torch.Tensor | None) -> torch.Tensor | None:
        return None if value is None else value[group.rows].float()

    return RowInputs(
        advantages=pick(inputs.advantages),
        old_logprobs=pick(inputs.old_logprobs),
        ref_logprobs=pick(inputs.ref_logprobs),
        sampler_logprobs=pick(inputs.sampler_logprobs),
    )


def needs_sequence_ratio(group: RowGroup) -> bool:
    """Whether a term of the group takes GSPO's per-sequence ratio: its coefficients then
    need the log-probs of every row of the group first."""
    return any(t.kind == "grpo" and t.ratio == "sequence" for t in group.terms)


def with_sequence_ratio(
    group: RowGroup, logprob: torch.Tensor, inputs: RowInputs, num_sequences: int
) -> RowInputs:
    """`inputs` with GSPO's seq_log_ratio filled from `logprob` [R], every row of the group."""
    old = logprob if inputs.old_logprobs is None else inputs.old_logprobs
    ratio = grpo.sequence_log_ratio(logprob - old, group.seq_ids, group.valid, num_sequences)
    return replace(inputs, seq_log_ratio=ratio)


def sampler_metrics(
    group: RowGroup, old: torch.Tensor, sampler_logprobs: torch.Tensor, token_mean: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Token means of the sampler/trainer mismatch metrics (losses.sampler) over the rows."""
    term = next((t for t in group.terms if t.kind == "grpo"), None)
    tis_cap = None if term is None else term.tis_cap
    per_row = sampler.row_metrics(old, sampler_logprobs, tis_cap)
    return {name: (token_mean * value).sum() for name, value in per_row.items()}


def combine(
    group: RowGroup, stats: RowStats, inputs: RowInputs, weights: GroupWeights
) -> GroupResult:
    """Loss, metrics and d loss / d logits coefficients of the group's rows."""
    loss = stats.lse.new_zeros(())
    metrics: dict[str, torch.Tensor] = {}
    grad = GradCoeffs()
    for term, agg in zip(group.terms, weights.terms, strict=True):
        term_loss = losses.row_loss(term, stats, inputs)
        value = (agg * term_loss.value).sum()
        scale = term.weight * group.head_scale
        loss = loss + scale * value
        grad.add_(term_loss.grad, scale * agg)
        prefix = f"mtp/{group.head}" if group.head else term.kind
        for name, per_row in term_loss.metrics.items():
            metrics[f"{prefix}/{name}"] = (weights.token_mean * per_row).sum()
        if group.head:
            metrics[f"{prefix}/loss"] = value
            metrics["mtp"] = group.head_scale * value
        else:
            metrics[term.kind] = value
    if not group.head:  # the metric is H itself, also when an entropy bonus term is present
        metrics["entropy"] = (weights.token_mean * stats.entropy).sum()
    if inputs.sampler_logprobs is not None:
        mismatch = sampler_metrics(
            group, inputs.old_logprobs, inputs.sampler_logprobs, weights.token_mean
        )
        metrics.update(mismatch)
    return GroupResult(loss=loss, metrics=metrics, grad=grad)


def add_metrics(total: dict[str, torch.Tensor], part: dict[str, torch.Tensor]) -> None:
    """total += part, name by name (chunks of one group, or groups of one plan)."""
    for name, value in part.items():
        total[name] = total[name] + value if name in total else value
