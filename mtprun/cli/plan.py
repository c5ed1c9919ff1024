"""`mtprun plan RECIPE [KEY=VALUE ...] [--json]`: the fused head-loss plan of a recipe, its
trunk terms (router losses), a mixture-of-experts model's experts per rank, the trainer's
estimated memory per rank and, for RL, the shape of the rollout loop."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table

from mtprun.cli.diagnostics import EXIT_INVALID, print_diagnostics
from mtprun.cli.plan_experts import experts_layout, experts_table
from mtprun.cli.tables import key_value_table

if TYPE_CHECKING:
    from mtprun.compiler import HeadPlan
    from mtprun.compiler.estimate import HeadCost
    from mtprun.preflight.memory import TrainerMemory
    from mtprun.spec import Recipe


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="Show the fused head-loss plan compiled from a recipe.",
        description="Compile the recipe's loss terms into one head-kernel plan and show its "
        "terms, statistics, collectives and estimated memory against the unfused way, and the "
        "trainer's estimated memory per rank.",
    )
    parser.add_argument("recipe", help="Recipe YAML file.")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument(
        "--json",
        action="store_true",
        help="Print the HeadPlan JSON (HeadPlan.from_json reads it) with the trainer's memory "
        "per rank in bytes under `trainer_memory` (null when the model shape is unknown), the "
        "trunk terms under `trunk_terms`, a mixture-of-experts model's layout under `experts` "
        "(null for a dense or unknown model), LoRA's trainable parameters and memory against "
        "full fine-tuning under `lora` (null without model.lora) and the RL loop's shape "
        "under `rollout_loop` (null without a task; with colocated placement the bytes of each "
        "phase on a GPU under its `colocated_memory`), and under `balance` whether each RL "
        "step's sequences are balanced across data-parallel replicas (null without a task).",
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
    from mtprun.preflight import check_recipe
    from mtprun.spec.rules import trunk_terms

    check = check_recipe(args.recipe, args.overrides)
    print_diagnostics(check.diagnostics)
    if check.recipe is None:
        return EXIT_INVALID
    # The compiler imports torch: only once a recipe is known to be valid.
    from mtprun.compiler import compile_recipe
    from mtprun.preflight.memory import recipe_trainer_memory

    recipe = check.recipe
    plan = compile_recipe(recipe)
    memory = recipe_trainer_memory(recipe, plan)
    experts = experts_layout(recipe, memory)
    lora = _lora_summary(recipe, memory, plan)
    if args.json:
        # The HeadPlan's own keys (HeadPlan.from_json reads them and ignores these).
        data = plan.to_dict()
        data["trainer_memory"] = None if isinstance(memory, str) else memory.to_dict()
        data["trunk_terms"] = [
            {"kind": t.kind, "weight": t.weight, "description": t.describe()[1]}
            for _, t in trunk_terms(recipe)
        ]
        data["experts"] = experts
        data["lora"] = lora
        data["rollout_loop"] = _rollout_loop(recipe)
        data["balance"] = _balance(recipe)
        data["reward_models"] = _reward_models(recipe)
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        cost = _cost(recipe, plan, args.head)
        parts = [_overview(recipe, plan, cost), _terms_table(recipe, plan)]
        if experts is not None:
            parts.append(experts_table(experts))
        if lora is not None:
            parts.append(_lora_table(lora))
        parts.append(_memory_table(recipe, memory))
        if recipe.task is not None:
            parts.append(_loop_table(recipe))
        if reward_models := _reward_models(recipe):
            parts.append(_reward_models_table(recipe, reward_models))
        Console().print(Group(*parts))
    return 0


def _rollout_loop(recipe: Recipe) -> dict | None:
    """The RL loop's shape: staleness, weight transfer and the bytes it moves per step (each
    engine receives the whole HF policy in `model.dtype`; null when the shape is unknown)."""
    from mtprun.preflight.memory import parameters
    from mtprun.preflight.model_shape import recipe_shape
    from mtprun.spec.resources import weight_transfer_method

    if recipe.task is None:
        return None
    rollout = recipe.rollout
    shape = recipe_shape(recipe)
    per_engine = None
    if not isinstance(shape, str):
        per_engine = parameters(shape) * (2 if recipe.model.dtype == "bfloat16" else 4)
    return {
        "max_staleness": rollout.max_staleness,
        "placement": recipe.resources.placement,
        "weight_transfer": weight_transfer_method(recipe),
        "engines": rollout.num_engines,
        "sync_bytes_per_engine": per_engine,
        "sync_bytes_per_step": None if per_engine is None else per_engine * rollout.num_engines,
        "colocated_memory": _colocated_phases(recipe),
    }


def _balance(recipe: Recipe) -> dict | None:
    """Whether each RL step's sequences are balanced across data-parallel replicas
    (trainer.balance, `mtprun.data.balance`), why not when they are not, and the cost model's
    `a` (cost L (a + L) per sequence of L tokens; its default when the shape is unknown here);
    null without a task (SFT rows are not rebalanced)."""
    from mtprun.data.balance import linear_length
    from mtprun.preflight.model_shape import recipe_shape

    if recipe.task is None:
        return None
    shape = recipe_shape(recipe)
    shape = None if isinstance(shape, str) else shape
    dp = recipe.parallel.dp
    if dp == 1:
        applies, why = False, "one data-parallel replica: nothing to balance"
    elif not recipe.trainer.balance:
        applies = False
        why = "trainer.balance is false: micro batches in rollout order, dealt round-robin"
    else:
        applies, why = True, ""
    return {"applies": applies, "why_not": why, "dp": dp, "linear_length": linear_length(shape)}


def _colocated_phases(recipe: Recipe) -> dict[str, int] | None:
    """Bytes on each colocated GPU in the generation, training and sync phases
    (`mtprun.preflight.colocation`); null when split or not countable here."""
    from mtprun.preflight.colocation import colocated_memory

    if recipe.resources.placement != "colocate":
        return None
    memory = colocated_memory(recipe)
    return None if isinstance(memory, str) else memory.phases()


def _reward_models(recipe: Recipe) -> list[dict]:
    """The reward models the run serves (task.reward / task.rewards {model, kind}): each one's
    folder, architecture, parameters, weights' bytes (its config's dtype) and the CPUs and GPUs
    its actor reserves (see mtprun.preflight.reward_models)."""
    from mtprun.preflight.reward_models import served_models

    return [model.to_dict() for model in served_models(recipe)]


def _reward_models_table(recipe: Recipe, models: list[dict]) -> Table:
    from mtprun.spec.actors import ActorDemand

    table = Table(
        title="served reward models (one vLLM engine per folder and kind, beside the rollout "
        "engines)"
    )
    for column in ("at", "kind", "architecture", "parameters", "weights", "actor"):
        table.add_column(column)
    for m in models:
        table.add_row(
            m["where"],
            m["kind"],
            m["architecture"],
            f"{m['parameters']:,}",
            f"{_mib(m['weight_bytes'])} ({m['dtype']}) + vLLM's KV cache",
            f"{m['cpus']:g} CPU, {m['gpus']:g} GPU",
        )
    demand = ActorDemand.of(recipe)
    table.caption = (
        f"the run's actors reserve {demand.need('CPU'):g} CPUs and {demand.need('GPU'):g} GPUs "
        f"at once ({demand.trainer_ranks} trainer ranks, {demand.engines} rollout engines, "
        f"{demand.reward_models} reward models)"
    )
    return table


def _loop_table(recipe: Recipe) -> Table:
    loop = _rollout_loop(recipe)
    table = key_value_table("RL loop")
    k = loop["max_staleness"]
    table.add_row(
        "rollouts",
        "synchronous: each step samples with the previous step's weights"
        if k == 0
        else f"asynchronous: engines generate up to {k} step(s) ahead of the trainer; an "
        f"episode trains a policy at most {k} optimizer step(s) newer than its sampler",
    )
    table.add_row("placement", _placement_text(loop))
    table.add_row("weight transfer", _TRANSFER_TEXT[loop["weight_transfer"]])
    per_engine = loop["sync_bytes_per_engine"]
    if per_engine is None:
        moved = "unknown: the model's shape is not known here"
    else:
        engines = loop["engines"]
        total = _mib(per_engine * engines)
        moved = f"{_mib(per_engine)} per engine x {engines} engine(s) = {total}"
    table.add_row("weights / step", f"{moved} ({recipe.model.dtype})")
    table.add_row("dp balancing", _balance_text(recipe, _balance(recipe)))
    return table


def _balance_text(recipe: Recipe, balance: dict) -> str:
    if not balance["applies"]:
        return f"off: {balance['why_not']}"
    return (
        f"on: each step's sequences split into {balance['dp']} groups of near-equal cost "
        f"L (a + L), a = {balance['linear_length']:,.0f} tokens (Karmarkar-Karp), each packed "
        f"first-fit decreasing into micro batches of <= {recipe.trainer.micro_batch_tokens} "
        "tokens, as many per replica as the sequences allow"
    )


_TRANSFER_TEXT = {
    "collective": "collective: trainer rank 0 broadcasts bucketed weights (NCCL on GPUs, gloo "
    "on CPU)",
    "cuda_ipc": "CUDA IPC: each trainer rank packs the weights into 1 GiB buckets on its GPU, "
    "the engine beside it copies them in place",
    "object_store": "object store: trainer rank 0 puts the weights in Ray's object store, each "
    "engine fetches them",
}


def _placement_text(loop: dict) -> str:
    if loop["placement"] != "colocate":
        return "split: the engines on GPUs of their own (or the CPU)"
    text = (
        "colocate: engine i shares trainer rank i's GPU; the engines sleep while the trainer "
        "trains, the trainer's optimizer state waits on the host while they generate"
    )
    phases = loop["colocated_memory"]
    if phases is not None:
        text += "; per GPU: " + ", ".join(
            f"{name} {_mib(nbytes)}" for name, nbytes in phases.items()
        )
    return text


def _cost(recipe: Recipe, plan: HeadPlan, head: list[int] | None) -> HeadCost | str:
    """The head-loss cost of one micro batch on one rank, or why it cannot be estimated."""
    from mtprun.compiler.estimate import estimate_head_cost
    from mtprun.preflight.memory import local_tokens
    from mtprun.preflight.model_shape import recipe_shape

    if head:
        hidden, vocab = head
    else:
        shape = recipe_shape(recipe)
        if isinstance(shape, str):
            return f"{shape} (give --head HIDDEN VOCAB)"
        hidden, vocab = shape.hidden, shape.vocab
    return estimate_head_cost(
        plan,
        rows=local_tokens(recipe.trainer.micro_batch_tokens, recipe.parallel.cp),
        hidden=hidden,
        vocab=vocab,
        param_bytes=2 if recipe.model.dtype == "bfloat16" else 4,
    )


def _overview(recipe: Recipe, plan: HeadPlan, cost: HeadCost | str) -> Table:
    table = key_value_table(f"{recipe.name}: HeadPlan {plan.hash}")
    table.add_row("statistics", ", ".join(plan.stats))
    table.add_row("metrics", ", ".join(plan.metrics))
    table.add_row("mask compaction", "on: rows outside the loss mask skip all vocab work")
    if plan.mtp_depths:
        table.add_row("MTP heads", ", ".join(f"t+{k}" for k in plan.mtp_depths))
    table.add_row("vocab passes", "1 statistics pass; backward rebuilds tiles from them")
    for name, value in _policy_rows(recipe, plan):
        table.add_row(name, value)
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


def _policy_rows(recipe: Recipe, plan: HeadPlan) -> list[tuple[str, str]]:
    """What the compiler made of the terms' options (each kind's own description) and the
    RL loop around them."""
    from mtprun import losses

    rows = [row for term in plan.terms if (row := losses.describe(term)) is not None]
    if recipe.task is not None:
        old = "the rollout engine's"
        if recipe.rollout.recompute_logprobs:
            old = "recomputed by the trainer before each update (engine's: sampler log-probs)"
        rows.append(("old log-probs", old))
        if recipe.task.drop_uniform_groups:
            rounds = recipe.task.max_sampling_rounds
            rows.append(("dynamic sampling", f"equal-reward groups dropped, <= {rounds} rounds"))
    if plan.norm_length is not None:
        rows.append(("seq-mean-token-sum-norm", f"token sums / {plan.norm_length} (constant)"))
    return rows


def _terms_table(recipe: Recipe, plan: HeadPlan) -> Table:
    """The head plan's terms, then the recipe's trunk terms (router losses) with their plan
    line: megatron-core computes them inside the trunk, the head kernel never sees them."""
    from mtprun.spec.rules import trunk_terms

    table = Table(title="terms")
    table.add_column("kind")
    table.add_column("weight", justify="right")
    table.add_column("settings")
    for term in plan.terms:
        settings = term.model_dump(exclude={"kind", "weight", "coef"})
        shown = ", ".join(f"{k}={v}" for k, v in settings.items())
        table.add_row(term.kind, f"{term.weight:g}", shown)
    for _, term in trunk_terms(recipe):
        kind, line = term.describe()
        table.add_row(kind, f"{term.weight:g}", line)
    return table


def _lora_summary(recipe: Recipe, memory: TrainerMemory | str, plan: HeadPlan) -> dict | None:
    """model.lora: its adapters, the trainable parameters (whole model and on the reported
    rank) and the memory per rank against full fine-tuning of the same recipe (null without
    model.lora; the counts null when the model's shape is not known here)."""
    from mtprun.preflight.memory import lora_layer_params, parameters, recipe_trainer_memory
    from mtprun.preflight.model_shape import recipe_shape

    lora = recipe.model.lora
    if lora is None:
        return None
    summary: dict = {
        "rank": lora.rank,
        "alpha": lora.alpha if lora.alpha is not None else 2.0 * lora.rank,
        "scaling": lora.scaling,
        "dropout": lora.dropout,
        "modules": list(lora.modules),
        "trainable_params": None,
        "base_params": None,
        "rank_trainable_params": None,
        "memory_per_rank": None,
        "full_finetune_memory_per_rank": None,
    }
    shape = recipe_shape(recipe)
    if isinstance(shape, str) or isinstance(memory, str):
        return summary
    full = recipe_trainer_memory(recipe, plan, full_finetune=True)
    assert not isinstance(full, str)
    summary.update(
        trainable_params=shape.layers * lora_layer_params(shape, 1, lora),
        base_params=parameters(shape),
        rank_trainable_params=memory.lora_params,
        memory_per_rank=memory.total,
        full_finetune_memory_per_rank=full.total,
    )
    return summary


def _lora_table(lora: dict) -> Table:
    table = key_value_table("LoRA")
    table.add_row(
        "adapters",
        f"rank {lora['rank']}, alpha {lora['alpha']:g} (scaling {lora['scaling']:g}), dropout "
        f"{lora['dropout']:g} on {', '.join(lora['modules'])} of every decoder layer",
    )
    table.add_row("frozen", "every base weight: no gradients, no optimizer state")
    if lora["trainable_params"] is None:
        table.add_row("trainable parameters", "unknown: the model's shape is not known here")
        return table
    trainable, base = lora["trainable_params"], lora["base_params"]
    table.add_row(
        "trainable parameters",
        f"{_count(trainable)} of {_count(base)} ({100 * trainable / base:.3g}%); "
        f"{_count(lora['rank_trainable_params'])} on a rank",
    )
    mine, full = lora["memory_per_rank"], lora["full_finetune_memory_per_rank"]
    unit, scale = ("GiB", 2**30) if full >= 2**30 else ("MiB", 2**20)
    table.add_row(
        "memory per rank",
        f"{mine / scale:.2f} {unit} against {full / scale:.2f} {unit} for full fine-tuning "
        f"(saves {(full - mine) / scale:.2f} {unit}, {100 * (full - mine) / full:.0f}%)",
    )
    table.add_row(
        "rollouts",
        "merged weights (W + scaling B A), moved whole; adapter-only transfer is not yet",
    )
    table.add_row(
        "checkpoints and export",
        "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors); "
        "`mtprun export --merge`: the merged HF folder",
    )
    return table


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


def _memory_table(recipe: Recipe, memory: TrainerMemory | str) -> Table:
    title = "trainer memory per rank"
    table = Table(title=title)
    table.add_column("part")
    if isinstance(memory, str):
        table.add_column("counted")
        table.add_row("model shape", memory)
        return table
    # GiB; a model under 1 GiB (a tiny CPU one) in MiB, so its numbers are not all 0.00.
    unit, scale = ("GiB", 2**30) if memory.total >= 2**30 else ("MiB", 2**20)
    table.add_column(unit, justify="right")
    table.add_column("counted")
    if memory.stages > 1:
        table.title = f"{title} (pipeline stage {memory.stage} of {memory.stages}, the largest)"
    bf16 = memory.bf16_weights
    shards = f"sharded over dp x cp = {memory.optimizer_shards} ranks"
    if memory.experts_per_rank and bf16:
        shards += f", the experts' over dp x cp / ep = {memory.expert_optimizer_shards}"
    moments = "bfloat16 " if memory.optimizer_state == "bfloat16" else ""
    state = {
        (True, "adamw"): f"AdamW: float32 master weights, {moments}exp_avg, exp_avg_sq; {shards}",
        (True, "sgd"): f"SGD: float32 master weights; {shards}",
        (False, "adamw"): "AdamW: exp_avg, exp_avg_sq (torch.optim, not sharded)",
        (False, "sgd"): "SGD without momentum: no state",
    }[bf16, recipe.trainer.optimizer]
    micro = "micro batch" if memory.in_flight == 1 else "micro batches (1F1B)"
    last = memory.stage == memory.stages - 1
    weights = "bf16 compute weights" if bf16 else "float32 weights"
    if memory.lora_params:  # LoRA: the frozen base and its adapters; only the adapters train
        weights += " (frozen base and LoRA adapters)"
        state += f"; of the {memory.lora_params:,} adapter parameters only"
    layers = f"{memory.layers} layers"
    if memory.experts_per_rank:
        weights += f"; {memory.experts_per_rank} experts of each sparse layer"
        layers = f"{memory.layers} layers ({memory.sparse_layers} sparse)"
    rows = [
        ("weights", memory.weights, weights),
        ("gradients", memory.gradients, _gradients_text(recipe, memory)),
        ("optimizer state", memory.optimizer, state),
        (
            f"activations (recompute: {memory.recompute})",
            memory.activations,
            f"{memory.tokens} tokens x {layers} x {memory.in_flight} {micro} "
            f"in flight, {recipe.model.dtype}, flash attention",
        ),
        (
            "head loss",
            memory.head_loss,
            "fused buffers of one micro batch" if last else "on the last pipeline stage",
        ),
    ]
    for part, n, how in rows:
        table.add_row(part, f"{n / scale:.2f}", how)
    budget = recipe.resources.gpu_memory_gib
    if budget is None:
        verdict = "a floor: no CUDA context, allocator slack or kernel workspaces"
    elif memory.total <= budget * 2**30:
        verdict = f"fits resources.gpu_memory_gib {budget:g}"
    else:
        verdict = f"[red]exceeds resources.gpu_memory_gib {budget:g}[/red]"
    table.add_row("[bold]total[/bold]", f"[bold]{memory.total / scale:.2f}[/bold]", verdict)
    return table


def _gradients_text(recipe: Recipe, memory: TrainerMemory) -> str:
    """The gradients' precision and when the data-parallel x context-parallel ranks sum them
    (`MegatronMixedPrecision`: bf16 weights reduce-scatter during the backward)."""
    from mtprun.models.pp_layout import PipelineStage, splits_tied_embedding
    from mtprun.preflight.model_shape import recipe_shape

    bf16 = memory.bf16_weights
    text = "float32 main gradients" if bf16 else "float32 gradients"
    text += " of the LoRA adapters" if memory.lora_params else ""
    ranks = recipe.parallel.dp * recipe.parallel.cp
    if ranks == 1:
        return text
    if not bf16:
        return f"{text}; all-reduced over dp x cp = {ranks} ranks after the backward"
    shape = recipe_shape(recipe)
    assert not isinstance(shape, str)  # `memory` was estimated from it
    # The test the trainer turns overlap_grad_reduce off by.
    if splits_tied_embedding(shape, PipelineStage(0, memory.stages, shape.layers)):
        return (
            f"{text}; reduce-scattered over dp x cp = {ranks} ranks after the backward, not "
            "during it: the tied embedding's two stages sum their gradients first"
        )
    return f"{text}; reduce-scattered over dp x cp = {ranks} ranks during the backward"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
