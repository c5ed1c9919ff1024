"""`eval:` the policy on held-out prompts, every `eval.every` RL steps, at the end, and by
`mtprun eval` on a saved checkpoint.

An evaluation samples `eval.samples` completions of each prompt (multi-turn tasks included)
with the eval section's sampling, scores them with the task's reward, and reports, under
`eval/`: `reward/mean`, each reward component, `reward/errors`, `pass_at_k` (pass@k) for each k of
`eval.pass_k` (a sample passes when its reward is >= `eval.pass_threshold`), `response/length`
and `prompts`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from mtprun.data.tasks import Prompt
from mtprun.runner.rollout.engine import Sampling
from mtprun.runner.rollout.episodes import EpisodeCollector
from mtprun.spec import Recipe
from mtprun.spec.eval import EvalSection
from mtprun.spec.sources import prompt_source


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with c passing samples out of n (Chen et al. 2021):
    the chance that k of the n samples, drawn without replacement, include a passing one."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_prompts(recipe: Recipe, collector: EpisodeCollector) -> list[Prompt]:
    """The prompts of `eval:`: its own dataset, or the task's held-out ones."""
    section = recipe.eval
    assert section is not None
    if section.prompts is None:
        return collector.task.heldout_prompts(section.num_prompts, recipe.seed)
    source, cache = prompt_source(section.prompts), Path(recipe.run_dir) / "datasets"
    return source.eval_prompts(section.prompts, recipe.seed, section.num_prompts, cache)


class Evaluator:
    def __init__(self, recipe: Recipe, collector: EpisodeCollector) -> None:
        if recipe.eval is None:
            raise ValueError("the recipe has no `eval:` section")
        self.section: EvalSection = recipe.eval
        self.collector = collector
        self.prompts = eval_prompts(recipe, collector)
        self.sampling = Sampling(
            self.section.temperature, self.section.top_p, self.section.max_tokens
        )

    def due(self, step: int, last_step: int) -> bool:
        every = self.section.every
        return bool(every and step % every == 0) or (self.section.at_end and step == last_step)

    def evaluate(self) -> dict[str, float]:
        """One evaluation of the engines' current policy: `eval/*` metrics."""
        section = self.section
        start = time.perf_counter()
        episodes = self.collector.run(self.prompts, section.samples, self.sampling)
        passed = (episodes.rewards >= section.pass_threshold).sum(dim=1).tolist()
        metrics = {
            "eval/reward/mean": float(episodes.rewards.mean()),
            "eval/response/length": float(torch.tensor(episodes.sampled_tokens).float().mean()),
            "eval/prompts": float(len(self.prompts)),
            **{f"eval/{k}": v for k, v in episodes.reward_metrics().items()},
        }
        for k in section.pass_k:
            scores = [pass_at_k(section.samples, c, k) for c in passed]
            metrics[f"eval/pass_at_{k}"] = sum(scores) / len(scores)
        metrics["time/eval_s"] = time.perf_counter() - start
        return metrics
