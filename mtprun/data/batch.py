"""The packed training batch handed from the data pipeline and the rollouts to the trainer."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mtprun.data.device_copy import to_device


@dataclass
class PackedBatch:
    """Sequences packed back to back into one row of T tokens.

    input_ids:    [T] int64 token ids.
    targets:      [T] int64, already shifted: row t predicts targets[t] (the next token of the
                  same sequence; the last token of each sequence has an arbitrary target and
                  loss_mask False).
    loss_mask:    [T] bool, True where the token at targets[t] is trained (the mask policy).
    position_ids: [T] int64, restarting at 0 at each sequence start.
    cu_seqlens:   [S+1] int32 sequence boundaries (0, len0, len0+len1, ...).
    advantages, old_logprobs, ref_logprobs: [T] float32 per target token (RL only) or None.
    sampler_logprobs: [T] float32, the rollout engine's log-probs when old_logprobs were
                  recomputed by the trainer (rollout.recompute_logprobs), else None.
    routed_experts: [T, L, k] int16, the experts the rollout engine routed each input token to
                  in each of the L decoder layers (global expert ids; rows of dense layers
                  unused), -1 on tokens whose routing it did not return (trainer.router_replay;
                  None otherwise). Per token, not per target: row t is how token t was routed.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch's tensors on `device` (onto a GPU without waiting for it: `to_device`)."""
        moved = {
            f.name: (to_device(v, device) if isinstance(v, torch.Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        return PackedBatch(**moved)
