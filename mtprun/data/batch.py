"""The packed training batch handed from the data pipeline and the rollouts to the trainer."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


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

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The batch's tensors on `device`. `non_blocking` onto a GPU: each host tensor is
        first copied into pinned memory, so the copy to the GPU is queued behind its work
        instead of waiting for it (a copy from pageable memory synchronizes the stream: one
        stall a field and micro batch, the GPU drained before the next micro batch begins)."""
        pin = non_blocking and torch.device(device).type == "cuda"

        def move(tensor: torch.Tensor) -> torch.Tensor:
            if pin and tensor.device.type == "cpu":
                tensor = tensor.pin_memory()
            return tensor.to(device, non_blocking=non_blocking)

        moved = {
            f.name: (move(v) if isinstance(v, torch.Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        return PackedBatch(**moved)
