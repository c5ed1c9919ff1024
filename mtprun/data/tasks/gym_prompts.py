"""A task whose prompts come from a reasoning-gym dataset (see mtprun.data.reasoning_gym)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mtprun.data.messages import Prompt
from mtprun.data.reasoning_gym import GymDataset
from mtprun.data.tasks.base import EVAL_PROMPTS, Task, step_seed

if TYPE_CHECKING:
    from mtprun.spec.data import ReasoningGymSpec


class ReasoningGymTask(Task):
    """Single-turn prompts of a reasoning-gym dataset of `size` entries generated from its
    seed (the recipe's by default). RL steps walk them epoch by epoch, each epoch in an order
    drawn from (seed, epoch), as dataset tasks do; an evaluation without eval.prompts reads
    entries of the same dataset generated from a seed of its own."""

    def __init__(self, spec: ReasoningGymSpec, seed: int) -> None:
        self.spec = spec
        self.name = f"reasoning_gym:{spec.reasoning_gym}"
        self.data = GymDataset(spec, seed if spec.seed is None else spec.seed)
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        order = np.random.default_rng([seed, 0x5A3F]).permutation(self.data.size)
        return [self.data.prompt(int(order[i % len(order)])) for i in range(n)]

    def step_prompts(self, n: int, seed: int, step: int, sampling_round: int = 0) -> list[Prompt]:
        if sampling_round:  # extra prompts of dynamic sampling: drawn, the stream goes on
            return self.prompts(n, step_seed(seed, step, sampling_round))
        out = []
        for position in range((step - 1) * n, step * n):
            epoch, index = divmod(position, self.data.size)
            out.append(self.data.prompt(int(self._order(seed, epoch)[index])))
        return out

    def _order(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._orders:
            order = np.random.default_rng([seed, epoch]).permutation(self.data.size)
            self._orders = {key: order}  # one epoch's order at a time in memory
        return self._orders[key]

    def heldout_prompts(self, n: int | None, seed: int) -> list[Prompt]:
        return gym_eval_prompts(self.spec, seed, n or EVAL_PROMPTS, own_seed=True)


def gym_eval_prompts(
    spec: ReasoningGymSpec, seed: int, n: int | None, own_seed: bool = False
) -> list[Prompt]:
    """The first `n` entries (all `spec.size` when None) of an evaluation's reasoning-gym
    dataset: generated from spec.seed, else from a seed drawn from the recipe's `seed` (so
    they are not the training entries); `own_seed`: always the drawn one, with `n` entries."""
    drawn = step_seed(seed, "eval")
    if own_seed:
        spec = spec.model_copy(update={"size": n or spec.size, "seed": drawn})
    data = GymDataset(spec, drawn if spec.seed is None else spec.seed)
    return [data.prompt(i) for i in range(min(n or data.size, data.size))]
