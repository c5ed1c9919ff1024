"""Cross-field rules: constraints that span sections, each reported at the offending value.

A rule is a function of a recipe that yields `Issue`s. It declares the sections it reads, and
runs only when those validated, so one broken section does not hide the other sections' errors
(the loader checks a partially valid recipe).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mtprun.spec.data import DATA_FILE_SUFFIXES
from mtprun.spec.document import KeyPath
from mtprun.spec.errors import Severity, did_you_mean
from mtprun.spec.model import VLLM_CPU_HEAD_DIMS, VOCAB_MULTIPLE
from mtprun.spec.model_shape import ModelShape, folder_shape, model_shape

if TYPE_CHECKING:
    from mtprun.spec.losses import LossTerm
    from mtprun.spec.recipe import Recipe

RL_LOSS_KINDS = frozenset({"grpo"})


@dataclass(frozen=True)
class Issue:
    path: KeyPath
    message: str
    severity: Severity = "error"

    @property
    def dotted_path(self) -> str:
        return ".".join(map(str, self.path)) or "<recipe>"


RuleFn = Callable[["Recipe"], Iterable[Issue]]
_RULES: list[tuple[frozenset[str], RuleFn]] = []


def rule(*sections: str) -> Callable[[RuleFn], RuleFn]:
    """Register a rule that reads `sections` of the recipe."""

    def register(fn: RuleFn) -> RuleFn:
        _RULES.append((frozenset(sections), fn))
        return fn

    return register


def check_rules(recipe: Recipe, invalid: frozenset[str] = frozenset()) -> list[Issue]:
    """Every issue of `recipe`, skipping rules that read a section named in `invalid`."""
    return [
        issue for sections, fn in _RULES if sections.isdisjoint(invalid) for issue in fn(recipe)
    ]


def _terms(recipe: Recipe) -> Iterator[tuple[int, LossTerm]]:
    # A partially valid recipe holds None where a term failed validation.
    return ((i, t) for i, t in enumerate(recipe.losses) if t is not None)


@rule("data", "task")
def _data_or_task(r: Recipe) -> Iterator[Issue]:
    if r.data is None and r.task is None:
        yield Issue((), "a recipe needs `data:` (SFT) or `task:` (RL); neither is set")
    elif r.data is not None and r.task is not None:
        yield Issue(
            ("data",),
            "`data:` (SFT) and `task:` (RL) are both set; to run SFT before RL, "
            "move `data:` under `warmstart:`",
        )


@rule("warmstart", "task")
def _warmstart_before_rl(r: Recipe) -> Iterator[Issue]:
    if r.warmstart is None:
        return
    if r.task is None:
        yield Issue(("warmstart",), "`warmstart:` is an SFT stage before RL and needs `task:`")
    elif r.warmstart.data.template != r.task.template:
        yield Issue(
            ("warmstart", "data", "template"),
            f"warm-start template '{r.warmstart.data.template}' differs from the task's "
            f"'{r.task.template}'; both stages train one model with one tokenizer",
        )


@rule("losses", "task")
def _rl_losses_need_task(r: Recipe) -> Iterator[Issue]:
    for i, term in _terms(r):
        if term.kind in RL_LOSS_KINDS and r.task is None:
            yield Issue(
                ("losses", i, "kind"),
                f"loss '{term.kind}' trains on rollouts and needs a `task:` with a `reward:`",
            )
    if r.task is not None and not any(t.kind in RL_LOSS_KINDS for _, t in _terms(r)):
        yield Issue(
            ("task",),
            "the task's rewards are unused: no loss term is a policy gradient (add kind: grpo)",
            "warning",
        )


@rule("losses", "rollout")
def _tis_needs_recomputed_logprobs(r: Recipe) -> Iterator[Issue]:
    for i, term in _terms(r):
        if term.kind == "grpo" and term.tis_cap is not None and not r.rollout.recompute_logprobs:
            yield Issue(
                ("losses", i, "tis_cap"),
                "tis_cap weighs each token by pi_old / pi_sampler, which needs the trainer's own "
                "old log-probs: set rollout.recompute_logprobs: true (or remove tis_cap)",
            )


@rule("losses", "model", "parallel")
def _teacher_fits_the_policy(r: Recipe) -> Iterator[Issue]:
    # The trainer runs the teacher split over the policy's TP group and compares the two
    # distributions token by token. A folder not readable here is reported by the runner.
    policy = model_shape(r.model)
    for i, term in _terms(r):
        teacher = folder_shape(term.teacher) if term.kind == "distill" else None
        if teacher is None:
            continue
        where = ("losses", i, "teacher")
        if policy is not None and policy.vocab is not None and teacher.vocab != policy.vocab:
            yield Issue(
                where,
                f"the teacher's {teacher.label('vocab')} is {teacher.vocab} but the policy's "
                f"{policy.label('vocab')} is {policy.vocab}: distillation needs one tokenizer",
            )
        names = ("heads", "kv_heads", "intermediate", "vocab")
        for name, count in _not_split_by(r.parallel.tp, teacher, names):
            yield Issue(
                where,
                f"parallel.tp {r.parallel.tp} does not divide {teacher.label(name)} "
                f"({count}): the teacher is split over the trainer's TP group too",
            )


@rule("parallel", "losses")
def _cp_keeps_token_terms(r: Recipe) -> Iterator[Issue]:
    # A context-parallel rank holds pieces of sequences (mtprun/runner/trainer/context_parallel.py).
    cp = r.parallel.cp
    if cp == 1:
        return
    for i, term in _terms(r):
        if term.kind == "mtp":
            yield Issue(
                ("losses", i, "kind"),
                f"an mtp term needs parallel.cp: 1 (it is {cp}): a draft row t is taught by the "
                "policy's row t+k, which may sit on another context-parallel rank",
            )
        elif term.loss_agg != "token-mean":
            yield Issue(
                ("losses", i, "loss_agg"),
                f"loss_agg {term.loss_agg} needs whole sequences and parallel.cp {cp} splits "
                "them over ranks; use loss_agg: token-mean",
            )
        if term.kind == "grpo" and term.ratio == "sequence":
            yield Issue(
                ("losses", i, "ratio"),
                f"ratio: sequence (GSPO) averages each sequence's log-ratio and parallel.cp {cp} "
                "splits sequences over ranks; use ratio: token or parallel.cp: 1",
            )


@rule("parallel", "model")
def _pp_splits_model(r: Recipe) -> Iterator[Issue]:
    shape, pp = model_shape(r.model), r.parallel.pp
    if shape is None:
        return
    for name, count in _not_split_by(pp, shape, ("layers",)):
        yield Issue(
            ("parallel", "pp"),
            f"pp {pp} does not divide {shape.label(name)} ({count}): each pipeline stage holds "
            "an equal share of the decoder layers",
        )


@rule("losses")
def _some_weight_positive(r: Recipe) -> Iterator[Issue]:
    terms = [t for _, t in _terms(r)]
    if terms and len(terms) == len(r.losses) and all(t.weight == 0 for t in terms):
        yield Issue(("losses",), "every loss term has weight 0 (coef for entropy): nothing trains")


@rule("losses")
def _one_term_per_kind(r: Recipe) -> Iterator[Issue]:
    first: dict[str, int] = {}
    for i, term in _terms(r):
        if term.kind in first:
            yield Issue(
                ("losses", i, "kind"),
                f"loss kind '{term.kind}' is already losses.{first[term.kind]}; "
                "one term per kind (merge their weights)",
            )
        first.setdefault(term.kind, i)


@rule("model")
def _tiny_model_shape(r: Recipe) -> Iterator[Issue]:
    tiny = r.model.tiny
    if tiny is None:
        return
    where = ("model", "tiny")
    if tiny.hidden % tiny.heads:
        yield Issue(
            (*where, "heads"), f"hidden {tiny.hidden} is not divisible by heads {tiny.heads}"
        )
    elif tiny.head_dim not in VLLM_CPU_HEAD_DIMS:
        fits = sorted(tiny.hidden // d for d in VLLM_CPU_HEAD_DIMS if tiny.hidden % d == 0)
        hint = f"; heads in {fits} fit hidden {tiny.hidden}" if fits else ""
        yield Issue(
            (*where, "heads"),
            f"head size hidden/heads = {tiny.head_dim} is not one vLLM's CPU attention accepts "
            f"({', '.join(map(str, VLLM_CPU_HEAD_DIMS))}){hint}",
        )
    if tiny.heads % tiny.kv_heads:
        yield Issue(
            (*where, "kv_heads"), f"heads {tiny.heads} is not divisible by kv_heads {tiny.kv_heads}"
        )
    if tiny.mtp_layers and tiny.architecture != "mimo":
        yield Issue(
            (*where, "mtp_layers"),
            f"MTP layers need architecture 'mimo', not '{tiny.architecture}'",
        )


@rule("losses", "model")
def _mtp_depth_fits_model(r: Recipe) -> Iterator[Issue]:
    shape = model_shape(r.model)
    if shape is None:
        return
    for i, term in _terms(r):
        if term.kind != "mtp" or term.depth <= shape.mtp_layers:
            continue
        yield Issue(
            ("losses", i, "depth"),
            f"mtp depth {term.depth} exceeds the model's MTP layers ({shape.mtp_layers}); "
            + _more_mtp_layers(shape, "mtp_layers >= depth"),
        )


@rule("rollout", "model")
def _speculative_needs_mtp(r: Recipe) -> Iterator[Issue]:
    spec, shape = r.rollout.speculative, model_shape(r.model)
    if spec is None or spec.method != "mtp" or shape is None:
        return
    where = ("rollout", "speculative")
    if shape.mtp_layers == 0:
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


@rule("rollout", "task")
def _speculation_needs_rollouts(r: Recipe) -> Iterator[Issue]:
    if r.rollout.speculative is not None and r.task is None:
        yield Issue(
            ("rollout", "speculative"),
            "speculative decoding only speeds up rollouts, and a recipe without `task:` samples "
            "nothing (SFT); add a `task:` or drop rollout.speculative",
            "warning",
        )


@rule("rollout", "task")
def _staleness_needs_rollouts(r: Recipe) -> Iterator[Issue]:
    if r.rollout.max_staleness > 0 and r.task is None:
        yield Issue(
            ("rollout", "max_staleness"),
            "max_staleness lets rollouts run ahead of the trainer, and a recipe without `task:` "
            "samples nothing (SFT); add a `task:` or drop rollout.max_staleness",
            "warning",
        )


def _not_split_by(tp: int, shape: ModelShape, names: tuple[str, ...]) -> Iterator[tuple[str, int]]:
    """(name, count) of each of `names` that `tp` ranks cannot split evenly."""
    for name in names:
        count = getattr(shape, name)
        if count % tp:
            yield name, count


def _more_mtp_layers(shape: ModelShape, setting: str) -> str:
    if shape.config is None:
        return f"set model.tiny.architecture: mimo and {setting}"
    return f"use a model with MTP layers ({shape.label('mtp_layers')} is {shape.mtp_layers})"


@rule("parallel", "model")
def _tp_splits_model(r: Recipe) -> Iterator[Issue]:
    shape, tp = model_shape(r.model), r.parallel.tp
    if shape is None or tp == 1:
        return
    # Each rank holds whole attention heads, a slice of the MLP and an equal vocab shard (the
    # trainer does not pad the vocab at run time; a tiny model's null vocab is padded to a
    # multiple of VOCAB_MULTIPLE when it is built).
    for name, count in _not_split_by(tp, shape, ("heads", "kv_heads", "intermediate")):
        yield Issue(("parallel", "tp"), f"tp {tp} does not divide {shape.label(name)} ({count})")
    vocab = shape.vocab if shape.vocab is not None else VOCAB_MULTIPLE
    if vocab % tp:
        fix = (
            f"set it to a multiple of {tp} (or leave it null)"
            if shape.config is None
            else "pad the checkpoint's vocabulary to a multiple of tp"
        )
        yield Issue(
            ("parallel", "tp"), f"tp {tp} does not divide {shape.label('vocab')} ({vocab}); {fix}"
        )


@rule("parallel", "resources")
def _world_size_matches(r: Recipe) -> Iterator[Issue]:
    world, p = r.resources.world_size, r.parallel
    if world is not None and world != p.world_size:
        yield Issue(
            ("resources", "world_size"),
            f"world_size {world} != tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp} = {p.world_size}",
        )


@rule("parallel", "resources", "rollout", "task")
def _local_ray_holds_the_actors(r: Recipe) -> Iterator[Issue]:
    res = r.resources
    if res.ray_address is not None:
        return  # a cluster's size is known when the run joins it (checked then)
    from mtprun.spec.actors import ActorDemand

    demand = ActorDemand.of(r)
    have = {"GPU": float(res.num_gpus)}
    if res.num_cpus is not None:  # null: Ray takes this machine's cores (checked at start)
        have["CPU"] = float(res.num_cpus)
    for resource in demand.short_of(have):
        if resource in have:
            field = "num_cpus" if resource == "CPU" else "num_gpus"
            where = f"the local Ray instance (resources.{field})"
            yield Issue(
                ("resources", field), demand.shortfall_message(resource, have[resource], where)
            )


@rule("rollout", "model", "task")
def _responses_fit_the_model(r: Recipe) -> Iterator[Issue]:
    shape = model_shape(r.model)
    if r.task is not None and shape is not None and r.rollout.max_tokens >= shape.max_seq_len:
        yield Issue(
            ("rollout", "max_tokens"),
            f"max_tokens {r.rollout.max_tokens} leaves no room for the prompt within "
            f"{shape.label('max_seq_len')} {shape.max_seq_len} (vLLM's max model length)",
        )


@rule("trainer")
def _warmup_within_steps(r: Recipe) -> Iterator[Issue]:
    if r.trainer.warmup_steps > r.trainer.steps:
        yield Issue(
            ("trainer", "warmup_steps"),
            f"warmup_steps {r.trainer.warmup_steps} > steps {r.trainer.steps}: the learning "
            "rate never reaches trainer.lr",
            "warning",
        )


@rule("task")
def _task_prompts_and_reward(r: Recipe) -> Iterator[Issue]:
    task = r.task
    if task is None:
        return
    if (task.name is None) == (task.prompts is None):
        yield Issue(
            ("task",),
            "a task needs `name:` (a built-in task) or `prompts:` (a dataset), "
            + ("not both" if task.name else "and has neither"),
        )
    if task.reward is None:
        if task.environment is None:
            yield Issue(
                ("task",),
                "a task needs `reward:` (a built-in reward such as exact_answer, or "
                "`file.py:function`), unless its task.environment rewards every episode",
            )
        return
    # The data package owns the rewards; it imports the reward (user code) to check it.
    from mtprun.data.rewards import reward_problem

    problem = reward_problem(task.reward)
    if problem is not None:
        yield Issue(("task", "reward"), problem)


@rule("task")
def _sampling_rounds_need_dynamic_sampling(r: Recipe) -> Iterator[Issue]:
    task = r.task
    if task is None or task.drop_uniform_groups:
        return
    if "max_sampling_rounds" in task.model_fields_set:
        yield Issue(
            ("task", "max_sampling_rounds"),
            "max_sampling_rounds bounds dynamic sampling, which is off: set "
            "task.drop_uniform_groups: true (or remove max_sampling_rounds)",
            "warning",
        )


@rule("task", "data", "warmstart", "eval")
def _sources_exist(r: Recipe) -> Iterator[Issue]:
    # The data package owns the registry of built-in tasks; imported only when checking.
    from mtprun.data.tasks import TASKS

    sources: list[tuple[KeyPath, Any]] = []
    if r.task is not None:
        sources += [(("task", "name"), r.task.name), (("task", "prompts"), r.task.prompts)]
    if r.data is not None:
        sources.append((("data", "source"), r.data.source))
    if r.warmstart is not None:
        sources.append((("warmstart", "data", "source"), r.warmstart.data.source))
    if r.eval is not None:
        sources.append((("eval", "prompts"), r.eval.prompts))
    for path, source in sources:
        if source is None:
            continue
        if isinstance(source, str) and source in TASKS:
            continue
        file = source if isinstance(source, str) else source.path
        where = path if isinstance(source, str) else (*path, "path")
        if not os.path.exists(file):
            if file.endswith(DATA_FILE_SUFFIXES) or not isinstance(source, str):
                yield Issue(where, f"file not found: {file}")
                continue
            name = os.path.basename(file)
            yield Issue(
                where,
                f"unknown built-in task '{name}'{did_you_mean(name, TASKS)}; built-in: "
                f"{', '.join(TASKS)}; or a dataset file or folder (none at {file})",
            )
        elif os.path.isfile(file) and not file.endswith(DATA_FILE_SUFFIXES):
            yield Issue(where, f"{file} is not a dataset file: use {', '.join(DATA_FILE_SUFFIXES)}")


@rule("eval", "task")
def _eval_has_prompts(r: Recipe) -> Iterator[Issue]:
    if r.eval is None:
        return
    if r.task is None:
        yield Issue(("eval",), "`eval:` scores the policy with the task's reward and needs `task:`")
        return
    dataset = r.task.prompts is not None or (r.task.name or "").endswith(DATA_FILE_SUFFIXES)
    held_out = r.task.prompts is not None and r.task.prompts.heldout > 0
    if r.eval.prompts is None and dataset and not held_out:
        yield Issue(
            ("eval",),
            "no evaluation prompts: hold rows out of the task's dataset (task.prompts.heldout: "
            "N or a fraction) or give eval.prompts",
        )


@rule("task")
def _environment_loads(r: Recipe) -> Iterator[Issue]:
    if r.task is None or r.task.environment is None:
        return
    # Imports the user's module (as the runner will): its errors are the recipe's.
    from mtprun.data.environment import load_environment_class

    try:
        load_environment_class(r.task.environment)
    except ValueError as err:
        yield Issue(("task", "environment"), f"task.environment: {err}")


@rule("model", "parallel", "trainer", "resources", "losses", "data", "task")
def _trainer_fits_gpu_memory(r: Recipe) -> Iterator[Issue]:
    gib = r.resources.gpu_memory_gib
    terms = [t for _, t in _terms(r)]
    if gib is None or not terms or len(terms) < len(r.losses) or model_shape(r.model) is None:
        return  # no budget, broken terms, or a model shape not known here: nothing to check
    # The estimate's head-loss part compiles the plan, which imports torch: only recipes that
    # ask for this check pay for it (`mtprun validate` stays torch-free otherwise).
    from mtprun.compiler.memory import GIB, over_budget_message, recipe_trainer_memory

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
