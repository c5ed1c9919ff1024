"""The frozen teacher of a `distill` term: a second Megatron-core model that only runs forward.

The fused head loss takes the teacher's final hidden states and output weight and applies the
teacher's output layer itself, chunk by chunk, so the teacher's [tokens x vocab] logits are
never materialized either.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtprun.models import ModelShape
from mtprun.runner.trainer.context_parallel import TokenShard
from mtprun.runner.trainer.model import load_policy_model


class Teacher:
    """The model of `model_dir`, split over the TP group like the student, never trained.

    Its vocabulary must be the student's: the distill term compares the two distributions
    token by token, and under TP both output layers then hold the same vocab shard.
    """

    def __init__(
        self,
        model_dir: Path,
        student: ModelShape,
        device: torch.device,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.shape = ModelShape.from_model_dir(model_dir)
        if self.shape.vocab != student.vocab:
            raise ValueError(
                f"losses: the distill teacher {model_dir} has a vocabulary of {self.shape.vocab} "
                f"tokens and the policy one of {student.vocab}; distillation compares their "
                "distributions token by token, so the teacher must use the policy's tokenizer"
            )
        self.model = load_policy_model(model_dir, self.shape, device, tp_rank, tp_size, dtype=dtype)
        self.model.eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def outputs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        shard: TokenShard | None = None,
    ) -> dict[str, torch.Tensor]:
        """HeadInputs.build's teacher arguments for the policy's inputs
        (`PolicyModel.hidden_states`' first arguments): teacher_hidden [T_local, Ht] (final
        hidden states) and teacher_weight [V/tp, Ht] (this rank's shard of the output layer)."""
        hidden, _ = self.model.hidden_states(input_ids, position_ids, cu_seqlens, shard=shard)
        weight = self.model.output_weight().to(hidden.dtype)
        return {"teacher_hidden": hidden, "teacher_weight": weight}
