"""What a run's Ray actors ask of the cluster.

The trainer ranks (tp*pp*cp*dp of them) live for the whole run; an RL run's rollout engines
(`rollout.num_engines`) live beside them, and so does each reward model the run serves
(`task.reward: {model, kind}`, or entries of task.rewards: one engine per model folder and
kind, shared by the terms that name both). Each actor reserves
`resources.cpus_per_actor` CPUs and `resources.gpus_per_actor` GPUs, so the cluster must hold
the sum at once: an actor that Ray cannot place waits forever, and the run with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mtprun.spec.document import KeyPath
from mtprun.spec.sections import RecipeSections
from mtprun.spec.sources import reward_source

Resource = Literal["CPU", "GPU"]
_PER_ACTOR_FIELD: dict[Resource, str] = {
    "CPU": "resources.cpus_per_actor",
    "GPU": "resources.gpus_per_actor",
}
_SLACK = 1e-9  # fractional shares (0.1 x 10) must not fail on rounding


@dataclass(frozen=True)
class ActorDemand:
    """The run's actors (trainer ranks, rollout engines, served reward models) and what each
    one reserves."""

    trainer_ranks: int
    engines: int
    cpus_per_actor: float
    gpus_per_actor: float
    reward_models: int = 0
    # resources.placement colocate: each engine shares its trainer rank's GPU.
    colocated: bool = False

    @classmethod
    def of(cls, recipe: RecipeSections) -> ActorDemand:
        res = recipe.resources
        engines = recipe.rollout.num_engines if recipe.is_rl else 0
        reward_models = len(served_engines(recipe)) if recipe.is_rl else 0
        return cls(
            recipe.parallel.world_size,
            engines,
            res.cpus_per_actor,
            res.gpus_per_actor,
            reward_models,
            colocated=res.placement == "colocate" and engines > 0,
        )

    def per_actor(self, resource: Resource) -> float:
        return self.cpus_per_actor if resource == "CPU" else self.gpus_per_actor

    def need(self, resource: Resource) -> float:
        actors = self.trainer_ranks + self.engines + self.reward_models
        if resource == "GPU" and self.colocated:
            actors -= self.engines  # on the trainer ranks' GPUs
        return actors * self.per_actor(resource)

    def short_of(self, have: dict[str, float]) -> list[Resource]:
        """The resources of which `have` (Ray's resource totals) holds less than the actors
        need."""
        resources: tuple[Resource, ...] = ("CPU", "GPU")
        return [r for r in resources if self.need(r) > have.get(r, 0.0) + _SLACK]

    def shortfall_message(self, resource: Resource, have: float, where: str) -> str:
        """Why the actors do not fit `where` (which has `have` of `resource`), and what to
        change."""
        groups = [
            (self.trainer_ranks, "trainer rank", "tp*pp*cp*dp", "parallel.dp/tp/pp/cp"),
            (self.engines, "rollout engine", "rollout.num_engines", "rollout.num_engines"),
            (self.reward_models, "served reward model", "task.reward(s)", "the served models"),
        ]
        actors = " + ".join(f"{_plural(n, noun)} ({why})" for n, noun, why, _ in groups if n)
        fewer = " or ".join(knob for n, _, _, knob in groups if n)
        field = _PER_ACTOR_FIELD[resource]
        remedy = (
            f"give Ray {resource}s, or set {field}: 0"
            if have <= 0
            else f"give Ray more {resource}s, lower {fewer}, or let actors share {resource}s "
            f"(a smaller {field})"
        )
        return (
            f"the run's actors need {_amount(self.need(resource))} {resource}s at once, "
            f"{actors} at {field} {self.per_actor(resource):g} each, and {where} has "
            f"{_amount(have)}: {remedy}"
        )


def served_rewards(recipe: RecipeSections) -> list[tuple[KeyPath, Any]]:
    """The reward models the run serves (the rewards that run actors of their own), each
    with where the recipe sets it."""
    task = recipe.task
    if task is None:
        return []
    found: list[tuple[KeyPath, Any]] = []
    if task.reward is not None and reward_source(task.reward).actors(task.reward):
        found.append((("task", "reward"), task.reward))
    for i, term in enumerate(task.rewards or ()):
        if reward_source(term.spec).actors(term.spec):
            found.append((("task", "rewards", i), term))
    return found


def served_engine_key(spec: Any) -> tuple[str, str]:
    """Served rewards with equal keys share one engine (one actor): it loads the folder, in
    the kind's runner, and nothing else of a term."""
    return str(Path(spec.model).resolve()), spec.kind


def served_engines(recipe: RecipeSections) -> list[list[tuple[KeyPath, Any]]]:
    """The engines the run serves its reward models on, each as the rewards sharing it (in
    the recipe's order)."""
    engines: dict[tuple[str, str], list[tuple[KeyPath, Any]]] = {}
    for where, spec in served_rewards(recipe):
        engines.setdefault(served_engine_key(spec), []).append((where, spec))
    return list(engines.values())


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _amount(x: float) -> str:
    return f"{round(x, 3):g}"
