"""Float64 reference of the fused head loss: materialises the logits and lets autograd derive
every gradient. Same call as `mtprun.kernels.head_loss` (checked `HeadInputs`), written
independently of the engine (plain loops for MTP validity and aggregation) so that the two
check each other.
The Triton kernels are tested against it as well.
"""

from __future__ import annotations

import torch

from mtprun.kernels import HeadInputs, HeadLossOutput
from mtprun.losses import LossTerm


def reference_head_loss(inputs: HeadInputs) -> HeadLossOutput:
    """Loss in float64 on `head_loss`'s checked inputs; gradients flow back to the given
    tensors (cast to their dtype)."""
    assert inputs.tp_group is None, "the reference is single-process: compare TP runs against it"
    assert inputs.tokens_per_sequence is None, "the reference weighs one call alone"
    plan, hidden, targets = inputs.plan, inputs.hidden, inputs.targets
    old_logprobs, sampler_logprobs = inputs.old_logprobs, inputs.sampler_logprobs
    n = hidden.shape[0]
    bounds = [int(b) for b in inputs.cu_seqlens]
    seq_of = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
    mask = [bool(m) for m in inputs.loss_mask]
    w64 = inputs.weight.double()
    logits = hidden.double() @ w64.T
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    valid = torch.tensor(mask)
    rows = [t for t in range(n) if mask[t]]

    loss = logits.new_zeros(())
    metrics: dict[str, torch.Tensor] = {"entropy": _token_mean(entropy, rows)}
    for term in plan.terms:
        if term.kind == "mtp":
            continue
        extra: dict[str, torch.Tensor] = {}
        if term.kind == "ce":
            per_token = -logp
        elif term.kind == "z_loss":
            per_token = logits.logsumexp(-1) ** 2
        elif term.kind == "entropy":
            per_token = -entropy
        elif term.kind == "grpo":
            old = logp.detach() if old_logprobs is None else old_logprobs.double()
            if term.ratio == "sequence":
                log_ratio = _gspo_log_ratio(logp, old, rows, seq_of)
            else:
                log_ratio = logp - old
            per_row = (inputs.advantages.double(), inputs.ref_logprobs, sampler_logprobs, old)
            per_token, extra = _grpo(term, logp, log_ratio, per_row, rows)
        elif term.kind == "distill":
            teacher = inputs.teacher_hidden.double() @ inputs.teacher_weight.double().T
            teacher = teacher / term.temperature
            per_token = -(teacher.softmax(-1) * logp_all).sum(-1)
        value = _aggregate(term, per_token, rows, seq_of, bounds, plan.norm_length)
        loss = loss + term.weight * value
        metrics[term.kind] = value.detach()
        metrics.update({f"{term.kind}/{k}": v.detach() for k, v in extra.items()})
    metrics["entropy"] = _token_mean(entropy, rows).detach()
    if sampler_logprobs is not None:
        grpo = plan.term("grpo")
        mismatch = old_logprobs.double() - sampler_logprobs.double()
        metrics["logprob_mismatch"] = _token_mean(mismatch.abs(), rows)
        if grpo is not None and grpo.tis_cap is not None:
            is_ratio = mismatch.exp()
            metrics["is_weight_mean"] = _token_mean(is_ratio.clamp(max=grpo.tis_cap), rows)
            metrics["is_clip_frac"] = _token_mean((is_ratio > grpo.tis_cap).double(), rows)

    mtp = plan.term("mtp")
    if mtp is not None:
        head_values = []
        for k in plan.mtp_depths:
            value, agree = _mtp_head(
                mtp, k, inputs.mtp_hidden[k - 1], w64, logits, targets, mask, seq_of
            )
            head_values.append(_aggregate(mtp, value[0], value[1], seq_of, bounds, None))
            metrics[f"mtp/{k}/loss"] = head_values[-1].detach()
            metrics[f"mtp/{k}/top1_agree"] = agree
        mtp_value = torch.stack(head_values).mean()
        loss = loss + mtp.weight * mtp_value
        metrics["mtp"] = mtp_value.detach()
    return HeadLossOutput(
        loss=loss, metrics=metrics, logprobs=torch.where(valid, logp, 0.0).detach()
    )


def _gspo_log_ratio(logp, old, rows, seq_of):
    """GSPO-token: the value of the sequence's mean log-ratio over its trained tokens, with
    the gradient of each token's own logp (sg(mean) + logp - sg(logp))."""
    by_seq: dict[int, list[int]] = {}
    for t in rows:
        by_seq.setdefault(seq_of[t], []).append(t)
    mean = torch.zeros_like(logp)
    for members in by_seq.values():
        seq_mean = (logp[members] - old[members]).mean().detach()
        for t in members:
            mean[t] = seq_mean
    return mean + logp - logp.detach()


def _grpo(term, logp, log_ratio, inputs, rows):
    advantages, ref_logprobs, sampler_logprobs, old = inputs
    ratio = torch.exp(log_ratio)
    if term.policy_loss == "cispo":
        cap = 1 + term.clip_high
        per_token = -ratio.clamp(max=cap).detach() * advantages * logp
        clip_frac = (ratio > cap).double()
    else:
        clipped = ratio.clamp(1 - term.clip_low, 1 + term.clip_high)
        surrogate = torch.minimum(ratio * advantages, clipped * advantages)
        clip_frac = (clipped * advantages < ratio * advantages).double()
        if term.clip_c is not None:
            dual = torch.maximum(surrogate, term.clip_c * advantages)
            dual_won = (advantages < 0) & (term.clip_c * advantages > surrogate)
            surrogate = torch.where(advantages < 0, dual, surrogate)
            clip_frac = torch.maximum(clip_frac, dual_won.double())
        per_token = -surrogate
    if term.tis_cap is not None:
        is_weight = torch.exp(old - sampler_logprobs.double()).clamp(max=term.tis_cap)
        per_token = per_token * is_weight
    kl = torch.zeros_like(logp)
    if ref_logprobs is not None:
        delta = logp - ref_logprobs.double()
        kl = {
            "k1": delta,
            "k2": delta**2 / 2,
            "k3": torch.exp(-delta) + delta - 1,
        }[term.kl_estimator]
    per_token = per_token + term.kl_coef * kl
    extra = {
        "clip_frac": _token_mean(clip_frac, rows).detach(),
        "kl": _token_mean(kl, rows).detach(),
        "ratio_mean": _token_mean(ratio, rows).detach(),
    }
    return per_token, extra


def _mtp_head(term, k, head_hidden, w64, logits, targets, mask, seq_of):
    """Per-token draft loss of head k on its valid rows, and the top-1 agreement."""
    n = len(mask)
    rows = [t for t in range(n - k) if mask[t] and mask[t + k] and seq_of[t] == seq_of[t + k]]
    draft_weight = w64 if term.train_shared_output else w64.detach()
    draft = (head_hidden.double() @ draft_weight.T).log_softmax(-1)
    per_token = draft.new_zeros(n)
    agree = []
    for t in rows:
        teacher = logits[t + k].detach()
        if term.target == "soft":
            per_token[t] = -(teacher.softmax(-1) * draft[t]).sum()
        elif term.target == "topk":
            values, ids = teacher.topk(term.topk)
            per_token[t] = -(values.softmax(-1) * draft[t][ids]).sum()
        else:
            per_token[t] = -draft[t][targets[t + k]]
        agree.append(float(draft[t].argmax() == teacher.argmax()))
    agree_mean = torch.tensor(sum(agree) / len(agree) if agree else 0.0, dtype=torch.float64)
    return (per_token, rows), agree_mean


def _aggregate(term: LossTerm, per_token, rows, seq_of, bounds, norm_length) -> torch.Tensor:
    if not rows:
        return per_token.sum() * 0.0
    if term.loss_agg == "token-mean":
        return per_token[rows].mean()
    by_seq: dict[int, list[int]] = {}
    for t in rows:
        by_seq.setdefault(seq_of[t], []).append(t)
    if term.loss_agg == "seq-mean-token-mean":
        return torch.stack([per_token[r].mean() for r in by_seq.values()]).mean()
    longest = max(bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1))
    sums = torch.stack([per_token[r].sum() for r in by_seq.values()])
    return sums.sum() / (len(by_seq) * (norm_length or longest))


def _token_mean(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if not rows:
        return values.new_zeros(())
    return values[rows].mean()
