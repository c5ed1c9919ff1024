"""`mtprun plan RECIPE [KEY=VALUE ...] [--json]`: the fused head-loss plan of a recipe."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table

from mtprun.cli.diagnostics import EXIT_INVALID, print_diagnostics
from mtprun.spec import Recipe, check_recipe
from mtprun.spec.model_shape import model_shape

if TYPE_CHECKING:
    from mtprun.compiler import HeadPlan
    from mtprun.compiler.estimate import HeadCost


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="Show the fused head-loss plan compiled from a recipe.",
        description="Compile the recipe's loss terms into one head-kernel plan and show its "
        "terms, statistics, collectives and estimated memory against the unfused way.",
    )
    parser.add_argument("recipe", help="Recipe YAML file.")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument(
        "--json", action="store_true", help="Print the HeadPlan JSON (HeadPlan.from_json reads it)."
    )
    parser.add_argument(
        "--head",
        nargs=2,
        type=_positive_int,
        metavar=("HIDDEN", "VOCAB"),
        help="Output-layer shape for the estimate when the model folder is not at hand "
        "(e.g. --head 3584 152064 for Qwen2.5-7B).",
    )
    parser.set_defaults(func=run)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    check = check_recipe(args.recipe, args.overrides)
    print_diagnostics(check.diagnostics)
    if check.recipe is None:
        return EXIT_INVALID
    # The compiler imports torch: only once a recipe is known to be valid.
    from mtprun.compiler import compile_recipe

    plan = compile_recipe(check.recipe)
    if args.json:
        print(plan.to_json())
    else:
        cost = _cost(check.recipe, plan, args.head)
        Console().print(Group(_overview(check.recipe, plan, cost), _terms_table(plan)))
    return 0


def _cost(recipe: Recipe, plan: HeadPlan, head: list[int] | None) -> HeadCost | str:
    """The head-loss cost of one micro batch on one rank, or why it cannot be estimated."""
    from mtprun.compiler.estimate import estimate_head_cost

    shape = tuple(head) if head else _head_shape(recipe)
    if isinstance(shape, str):
        return shape
    hidden, vocab = shape
    # A context-parallel rank holds two of the micro batch's 2*cp chunks.
    chunks = 2 * recipe.parallel.cp
    return estimate_head_cost(
        plan,
        rows=2 * -(-recipe.trainer.micro_batch_tokens // chunks),
        hidden=hidden,
        vocab=vocab,
        param_bytes=2 if recipe.model.dtype == "bfloat16" else 4,
    )


def _head_shape(recipe: Recipe) -> tuple[int, int] | str:
    """(hidden, vocab) of the output layer, or why they are unknown."""
    shape = model_shape(recipe.model)
    if shape is None:
        config = Path(recipe.model.path or "") / "config.json"
        return f"unknown: {config} not readable here (give --head HIDDEN VOCAB)"
    if shape.vocab is not None:
        return shape.hidden, shape.vocab
    assert recipe.model.tiny is not None  # a model folder's shape always has its vocab
    return shape.hidden, recipe.model.tiny.vocab_size(_tokenizer_size(recipe))


def _tokenizer_size(recipe: Recipe) -> int:
    from mtprun.data.tokenizer import build_tokenizer

    section = recipe.data or recipe.task
    assert section is not None  # a valid recipe has one of them
    return len(build_tokenizer(section.template))


def _overview(recipe: Recipe, plan: HeadPlan, cost: HeadCost | str) -> Table:
    table = Table(title=f"{recipe.name}: HeadPlan {plan.hash}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("statistics", ", ".join(plan.stats))
    table.add_row("metrics", ", ".join(plan.metrics))
    table.add_row("mask compaction", "on: rows outside the loss mask skip all vocab work")
    if plan.mtp_depths:
        table.add_row("MTP heads", ", ".join(f"t+{k}" for k in plan.mtp_depths))
    table.add_row("vocab passes", "1 statistics pass; backward rebuilds tiles from them")
    table.add_row("tensor parallel", str(plan.tp_size))
    if isinstance(cost, str):
        table.add_row("head shape", cost)
        return table
    padding = (
        f" (padded to {cost.padded_vocab}, a multiple of tp)"
        if cost.padded_vocab != cost.vocab
        else ""
    )
    table.add_row(
        "head shape", f"{cost.rows} rows x hidden {cost.hidden} -> vocab {cost.vocab}{padding}"
    )
    table.add_row(
        "collectives / micro batch",
        f"fused {cost.fused_collectives}, unfused {cost.unfused_collectives}",
    )
    ratio = cost.unfused_bytes / cost.fused_bytes
    table.add_row(
        "head-loss memory / micro batch",
        f"fused {_mib(cost.fused_bytes)}, unfused {_mib(cost.unfused_bytes)} ({ratio:.1f}x)",
    )
    return table


def _terms_table(plan: HeadPlan) -> Table:
    table = Table(title="terms")
    table.add_column("kind")
    table.add_column("weight", justify="right")
    table.add_column("settings")
    for term in plan.terms:
        settings = term.model_dump(exclude={"kind", "weight", "coef"})
        shown = ", ".join(f"{k}={v}" for k, v in settings.items())
        table.add_row(term.kind, f"{term.weight:g}", shown)
    return table


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
