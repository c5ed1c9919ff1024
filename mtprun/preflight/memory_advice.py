"""What to tell a user whose trainer does not fit its memory (`mtprun validate`'s warning and
the trainer's refusal before it loads anything): the estimate's parts, the largest, and the
recipe change that shrinks it."""

from __future__ import annotations

from mtprun.preflight.memory import GIB, PART_LABELS, PARTS, TrainerMemory


def over_budget_message(memory: TrainerMemory, budget: str, micro_batch_tokens: int) -> str:
    """Why `memory` does not fit in `budget` (the memory it was held against, in words), and
    what to change."""
    parts = memory.parts()
    largest = memory.largest()
    where = f" (pipeline stage {memory.stage} of {memory.stages})" if memory.stages > 1 else ""
    breakdown = ", ".join(
        f"{PART_LABELS[name]} {_gib(parts[name])}"
        + (f" (recompute {memory.recompute})" if name == "activations" else "")
        for name in PARTS
    )
    return (
        f"the trainer needs an estimated {_gib(memory.total)} GiB per rank{where}, more than "
        f"{budget}; {PART_LABELS[largest]} is the largest part ({breakdown} GiB; "
        "`mtprun plan` shows how they are counted): " + _remedy(memory, largest, micro_batch_tokens)
    )


def _remedy(memory: TrainerMemory, largest: str, micro_batch_tokens: int) -> str:
    smaller = f"a smaller trainer.micro_batch_tokens (now {micro_batch_tokens})"
    if largest == "activations":
        options = []
        if memory.recompute != "full":
            options.append("trainer.recompute: full")
        options += [smaller, "more parallel.tp or parallel.cp (they split each micro batch)"]
        return "try " + ", ".join(options[:-1]) + " or " + options[-1]
    if largest == "head_loss":
        return f"try {smaller} or more parallel.tp (it splits the vocab)"
    lower = ""
    if largest == "optimizer" and memory.bf16_weights and memory.optimizer_state == "float32":
        lower = "trainer.optimizer_state: bfloat16 (AdamW's moments in 4 bytes, not 8), "
    if memory.experts_per_rank > 0 and memory.expert_params:
        return (
            f"try {lower}more parallel.ep (each rank now holds {memory.experts_per_rank} experts "
            "of every sparse layer; ep divides dp, so raise dp with it) or more parallel.pp"
        )
    if largest == "optimizer" and memory.bf16_weights:
        return (
            f"try {lower}more parallel.dp (the distributed optimizer shards its state over "
            "dp x cp) or more parallel.tp or parallel.pp"
        )
    if largest == "optimizer":
        return (
            "try model.dtype: bfloat16 (bf16 weights and an optimizer state sharded over "
            "dp x cp) or more parallel.tp or parallel.pp"
        )
    return "try more parallel.tp or parallel.pp (they split the weights and their gradients)"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"
