"""`mtprun inspect-data RECIPE [KEY=VALUE ...] [-n 3]`: what the loss trains, token by token.

Renders samples of every data source of a recipe (`data`, `warmstart.data`, `task`) with the
tokens the mask policy trains highlighted, a per-role count and the trained fraction. RL tasks
are shown through the real rollout loop with the task's scripted expert in place of the
policy, so tool outputs appear as the environment inserts them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mtprun.cli.diagnostics import EXIT_INVALID, print_diagnostics

if TYPE_CHECKING:
    import torch

    from mtprun.data.render import RenderedSequence, Renderer
    from mtprun.spec import Recipe

TRAINED_STYLE = "bold black on green"
ROLE_STYLES = {"system": "magenta", "user": "cyan", "assistant": "white", "tool": "yellow"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect-data",
        help="Show rendered samples with the tokens the loss trains highlighted.",
        description="Render samples of the recipe's data and RL task with its chat template "
        "and mask policy; trained tokens are highlighted, untrained ones dimmed in their "
        "role's colour. RL tasks run their scripted expert in place of the policy.",
    )
    parser.add_argument("recipe", help="Recipe YAML file.")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument(
        "-n", "--num-samples", type=int, default=3, help="Samples per data source (default 3)."
    )
    parser.set_defaults(func=run)


@dataclass
class Sample:
    sequence: RenderedSequence
    note: str = ""


@dataclass
class Source:
    title: str
    renderer: Renderer
    samples: list[Sample]
    problems: list[str]


def run(args: argparse.Namespace) -> int:
    if args.num_samples < 1:
        print("mtprun inspect-data: -n must be at least 1", file=sys.stderr)
        return EXIT_INVALID
    from mtprun.preflight import check_recipe

    check = check_recipe(args.recipe, args.overrides)
    print_diagnostics(check.diagnostics)
    if check.recipe is None:
        return EXIT_INVALID
    # torch and transformers load only once the recipe is known to be valid.
    from mtprun.data.dataset_files import DataFileError

    console = Console(highlight=False)
    try:
        sources = list(_sources(check.recipe, args.num_samples))
    except (DataFileError, ValueError) as err:
        Console(stderr=True, highlight=False).print(
            Text(f"mtprun inspect-data: {err}", style="red"), soft_wrap=True
        )
        return EXIT_INVALID
    totals = [0, 0]
    for source in sources:
        trained, tokens = _print_source(console, source, check.recipe.mask)
        totals[0] += trained
        totals[1] += tokens
    fraction = totals[0] / max(totals[1], 1)
    console.print(
        Text(f"\ntrained fraction: {fraction:.1%} ({totals[0]} of {totals[1]} tokens)", "bold")
    )
    return 0


def _sources(recipe: Recipe, n: int) -> Iterator[Source]:
    from mtprun.data.prompts import ConversationDataset
    from mtprun.data.render import renderer_for
    from mtprun.data.rewards import RewardInput, call_reward, load_reward
    from mtprun.data.sft import load_conversations
    from mtprun.data.tasks import load_environment_class, task_for
    from mtprun.data.trajectory import expert_rollout
    from mtprun.sources.scoring import InWorkers
    from mtprun.spec.sources import prompt_source, reward_source

    model_path = recipe.model.path
    sft_sections = [("data", recipe.data)]
    if recipe.warmstart is not None:
        sft_sections.append(("warmstart.data", recipe.warmstart.data))
    for label, data in sft_sections:
        if data is None:
            continue
        renderer = renderer_for(data.template, model_path, data.renderer)
        loaded = load_conversations(data, recipe.seed)
        samples = [
            Sample(sequence)
            for i in range(min(n, len(loaded)))
            for sequence in renderer.render_training(loaded[i])
        ]
        errors = loaded.errors if isinstance(loaded, ConversationDataset) else []
        source = data.source if isinstance(data.source, str) else data.source.path
        title = f"{label}: {source} (SFT, template {data.template})"
        yield Source(title, renderer, samples, [str(e) for e in errors])
    if recipe.task is not None:
        task_section = recipe.task
        renderer = renderer_for(task_section.template, model_path, task_section.renderer)
        task = task_for(task_section, recipe.seed)
        # A rule reward (one run in the reward workers) scores the expert's episodes; a judge
        # (or several rewards by weight) is not called here.
        effective = task_section.effective_reward
        plan = reward_source(effective).scoring(effective) if effective is not None else None
        reward = load_reward(plan.reference) if isinstance(plan, InWorkers) else None
        environment = (
            load_environment_class(task_section.environment) if task_section.environment else None
        )
        samples = []
        for prompt in task.prompts(n, recipe.seed):
            trajectory, conversation, score = expert_rollout(
                task, prompt, renderer, task_section.episode_turns, environment
            )
            turns = sum(m.role == "assistant" for m in conversation)
            if score is None and reward is not None:  # the environment gave none
                score = call_reward(reward, RewardInput.of(prompt, conversation))["total"]
            note = f"{turns} assistant turn(s), reward " + (
                "none" if score is None else f"{score:g}"
            )
            samples.append(Sample(trajectory, note))
        prompts = task_section.prompts
        name = task_section.name if prompts is None else prompt_source(prompts).describe(prompts)
        title = (
            f"task: {name} (RL, template {task_section.template}, "
            "scripted expert in place of the policy)"
        )
        yield Source(title, renderer, samples, [])


def _print_source(console: Console, source: Source, mask: object) -> tuple[int, int]:
    from mtprun.data.mask import token_mask

    console.rule(Text(source.title, "bold"))
    for problem in source.problems:
        console.print(Text(f"skipped bad record {problem}", "yellow"), soft_wrap=True)
    legend = Text("mask ")
    legend.append(f"{mask}", "bold")
    legend.append(": ")
    legend.append("trained", TRAINED_STYLE)
    for role, style in ROLE_STYLES.items():
        legend.append(" ")
        legend.append(f"{role}", f"dim {style}")
    console.print(legend)
    trained_total = tokens_total = 0
    for i, sample in enumerate(source.samples, 1):
        trained = token_mask(sample.sequence, mask)
        console.print(Text(f"\nsample {i}" + (f" ({sample.note})" if sample.note else ""), "bold"))
        console.print(_highlighted(source.renderer, sample.sequence, trained))
        console.print(_counts(source.renderer, sample.sequence, trained))
        trained_total += int(trained.sum())
        tokens_total += len(sample.sequence)
    return trained_total, tokens_total


def _highlighted(renderer: Renderer, sequence: RenderedSequence, trained: torch.Tensor) -> Text:
    text = Text()
    pieces = renderer.tokenizer.batch_decode([[t] for t in sequence.token_ids.tolist()])
    for piece, role, is_trained in zip(
        pieces, sequence.role_names(), trained.tolist(), strict=True
    ):
        # A newline is shown as a visible mark so a trained newline can be seen.
        shown = piece.replace("\n", "\u21b5\n")
        text.append(shown, TRAINED_STYLE if is_trained else f"dim {ROLE_STYLES[role]}")
    text.rstrip()
    return text


def _counts(renderer: Renderer, sequence: RenderedSequence, trained: torch.Tensor) -> Table:
    from mtprun.data.messages import ROLES

    table = Table(box=None, pad_edge=False)
    for column in ("role", "tokens", "trained"):
        table.add_column(column, justify="left" if column == "role" else "right")
    roles = sequence.roles
    for role_id, role in enumerate(ROLES):
        of_role = roles == role_id
        if of_role.any():
            table.add_row(role, str(int(of_role.sum())), str(int((trained & of_role).sum())))
    is_stop = _isin(sequence.token_ids, renderer.stop_token_ids)
    table.add_row("stop tokens", str(int(is_stop.sum())), str(int((trained & is_stop).sum())))
    n_trained = int(trained.sum())
    table.add_row("all", str(len(sequence)), f"{n_trained} ({n_trained / len(sequence):.1%})")
    return table


def _isin(values: torch.Tensor, ids: list[int]) -> torch.Tensor:
    import torch

    return torch.isin(values, torch.tensor(ids, dtype=values.dtype))
