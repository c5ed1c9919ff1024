"""Cross-field rules: constraints that span sections, each reported at the offending value.

A rule is a function of a recipe that yields `Issue`s. It declares the sections it reads, and
runs only when those validated, so one broken section does not hide the other sections' errors
(the loader checks a partially valid recipe).

`SPEC_RULES` are the recipe's own: they read nothing but the recipe, so `Recipe` checks them
whenever it is built (they read its `RecipeSections`, so the two do not import each other).
The rules that hold a recipe against what lies outside it (files, the model's config.json,
Python code it names, the memory estimate) extend them in `mtprun.preflight.rules`, the layer
that may import the data, models and compiler they need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mtprun.losses import is_trunk_term
from mtprun.spec.actors import ActorDemand
from mtprun.spec.data import DATA_FILE_SUFFIXES, SEARCH_TASK, DatasetSpec, TaskSection
from mtprun.spec.document import KeyPath
from mtprun.spec.errors import Severity
from mtprun.spec.families import MOE_ARCHITECTURES, MTP_ARCHITECTURES
from mtprun.spec.model import VLLM_CPU_HEAD_DIMS
from mtprun.spec.sections import RecipeSections

if TYPE_CHECKING:
    from mtprun.losses import LossTerm
    from mtprun.losses.router import TrunkTermConfig

RL_LOSS_KINDS = frozenset({"grpo"})


@dataclass(frozen=True)
class Issue:
    path: KeyPath
    message: str
    severity: Severity = "error"

    @property
    def dotted_path(self) -> str:
        return ".".join(map(str, self.path)) or "<recipe>"


RuleFn = Callable[[RecipeSections], Iterable[Issue]]


class RuleSet:
    """Rules in the order they run: those of the sets it extends first, then its own."""

    def __init__(self, *extends: RuleSet) -> None:
        self._extends = extends
        self._own: list[tuple[frozenset[str], RuleFn]] = []

    def rule(self, *sections: str) -> Callable[[RuleFn], RuleFn]:
        """Register a rule that reads `sections` of the recipe."""

        def register(fn: RuleFn) -> RuleFn:
            self._own.append((frozenset(sections), fn))
            return fn

        return register

    def check(self, recipe: RecipeSections, invalid: frozenset[str] = frozenset()) -> list[Issue]:
        """Every issue of `recipe`, skipping rules that read a section named in `invalid`."""
        issues = [issue for base in self._extends for issue in base.check(recipe, invalid)]
        for sections, fn in self._own:
            if sections.isdisjoint(invalid):
                issues += fn(recipe)
        return issues


SPEC_RULES = RuleSet()
rule = SPEC_RULES.rule


def loss_terms(recipe: RecipeSections) -> Iterator[tuple[int, LossTerm]]:
    """(index, term) of the recipe's head terms; a partially valid recipe holds None where a
    term failed validation (skipped here), and trunk terms are `trunk_terms`'."""
    return ((i, t) for i, t in enumerate(recipe.losses) if t is not None and not is_trunk_term(t))


def trunk_terms(recipe: RecipeSections) -> Iterator[tuple[int, TrunkTermConfig]]:
    """(index, term) of the recipe's trunk terms (router losses)."""
    return ((i, t) for i, t in enumerate(recipe.losses) if is_trunk_term(t))


@rule("data", "task")
def _data_or_task(r: RecipeSections) -> Iterator[Issue]:
    if r.data is None and r.task is None:
        yield Issue((), "a recipe needs `data:` (SFT) or `task:` (RL); neither is set")
    elif r.data is not None and r.task is not None:
        yield Issue(
            ("data",),
            "`data:` (SFT) and `task:` (RL) are both set; to run SFT before RL, "
            "move `data:` under `warmstart:`",
        )


@rule("warmstart", "task")
def _warmstart_before_rl(r: RecipeSections) -> Iterator[Issue]:
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
def _rl_losses_need_task(r: RecipeSections) -> Iterator[Issue]:
    for i, term in loss_terms(r):
        if term.kind in RL_LOSS_KINDS and r.task is None:
            yield Issue(
                ("losses", i, "kind"),
                f"loss '{term.kind}' trains on rollouts and needs a `task:` with a `reward:`",
            )
    if r.task is not None and not any(t.kind in RL_LOSS_KINDS for _, t in loss_terms(r)):
        yield Issue(
            ("task",),
            "the task's rewards are unused: no loss term is a policy gradient (add kind: grpo)",
            "warning",
        )


@rule("losses", "rollout")
def _tis_needs_recomputed_logprobs(r: RecipeSections) -> Iterator[Issue]:
    for i, term in loss_terms(r):
        if term.kind == "grpo" and term.tis_cap is not None and not r.rollout.recompute_logprobs:
            yield Issue(
                ("losses", i, "tis_cap"),
                "tis_cap weighs each token by pi_old / pi_sampler, which needs the trainer's own "
                "old log-probs: set rollout.recompute_logprobs: true (or remove tis_cap)",
            )


@rule("parallel", "losses")
def _cp_keeps_token_terms(r: RecipeSections) -> Iterator[Issue]:
    # A context-parallel rank holds pieces of sequences (mtprun/runner/trainer/context_parallel.py).
    cp = r.parallel.cp
    if cp == 1:
        return
    for i, term in loss_terms(r):
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


@rule("losses")
def _some_weight_positive(r: RecipeSections) -> Iterator[Issue]:
    terms = [t for _, t in loss_terms(r)]
    valid = [t for t in r.losses if t is not None]
    if not valid or len(valid) < len(r.losses):
        return  # an empty list or a broken term is reported on its own
    if not terms:
        yield Issue(
            ("losses",),
            "losses has only trunk terms (router_aux, router_z): they shape the router, and "
            "the policy needs a head term too (kind: ce for SFT, grpo for RL)",
        )
    elif all(t.weight == 0 for t in terms):
        yield Issue(("losses",), "every loss term has weight 0 (coef for entropy): nothing trains")


@rule("trainer", "model", "losses")
def _bf16_moments_need_megatron_optimizer(r: RecipeSections) -> Iterator[Issue]:
    # bf16 moments live in the bf16-weight path's optimizer (megatron-core's distributed
    # optimizer); float32 weights and a separately stepped MTP head train with torch.optim.
    if r.trainer.optimizer_state == "float32":
        return
    separate = any(getattr(t, "separate_optimizer", False) for t in r.losses if t is not None)
    if r.model.dtype != "bfloat16" or separate:
        why = (
            "model.dtype is float32"
            if r.model.dtype != "bfloat16"
            else ("the mtp term's separate_optimizer steps with torch.optim")
        )
        yield Issue(
            ("trainer", "optimizer_state"),
            f"optimizer_state bfloat16 applies to bf16 weights on megatron-core's optimizer, and "
            f"{why}: set model.dtype: bfloat16 (without mtp.separate_optimizer) or "
            "optimizer_state: float32",
        )


@rule("losses")
def _one_term_per_kind(r: RecipeSections) -> Iterator[Issue]:
    first: dict[str, int] = {}
    for i, term in ((i, t) for i, t in enumerate(r.losses) if t is not None):
        if term.kind in first:
            yield Issue(
                ("losses", i, "kind"),
                f"loss kind '{term.kind}' is already losses.{first[term.kind]}; "
                "one term per kind (merge their weights)",
            )
        first.setdefault(term.kind, i)


@rule("model")
def _tiny_model_shape(r: RecipeSections) -> Iterator[Issue]:
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
    if tiny.mtp_layers and tiny.architecture not in MTP_ARCHITECTURES:
        yield Issue(
            (*where, "mtp_layers"),
            f"MTP layers need architecture {' or '.join(map(repr, MTP_ARCHITECTURES))}, not "
            f"'{tiny.architecture}'",
        )
    if tiny.experts is not None and tiny.architecture not in MOE_ARCHITECTURES:
        yield Issue(
            (*where, "experts"),
            f"experts need a mixture-of-experts architecture ({', '.join(MOE_ARCHITECTURES)}), "
            f"not '{tiny.architecture}'; drop model.tiny.experts or set architecture: "
            f"{MOE_ARCHITECTURES[0]}",
        )
    elif tiny.experts is not None and tiny.experts.top_k > tiny.experts.count:
        yield Issue(
            (*where, "experts", "top_k"),
            f"top_k {tiny.experts.top_k} is more than the {tiny.experts.count} experts",
        )


# vLLM-cpu (0.32) pads an expert width that is not a multiple of this for its MoE kernel, and
# its weight reload then copies the unpadded checkpoint tensors into the padded ones and fails
# ("The size of tensor a (128) must match the size of tensor b (96)" at width 48).
VLLM_CPU_EXPERT_WIDTH_MULTIPLE = 32


@rule("model")
def _tiny_expert_width_fits_vllm_cpu(r: RecipeSections) -> Iterator[Issue]:
    tiny = r.model.tiny
    if tiny is None or tiny.experts is None:
        return
    width, multiple = tiny.experts.intermediate, VLLM_CPU_EXPERT_WIDTH_MULTIPLE
    if width % multiple:
        fits = [n for n in (width // multiple * multiple, -(-width // multiple) * multiple) if n]
        yield Issue(
            ("model", "tiny", "experts", "intermediate"),
            f"expert width {width} is not a multiple of {multiple}: vLLM-cpu pads other widths "
            "and its weight reload into the rollout engines then fails; write "
            + " or ".join(map(str, fits)),
        )


@rule("rollout", "task")
def _speculation_needs_rollouts(r: RecipeSections) -> Iterator[Issue]:
    if r.rollout.speculative is not None and r.task is None:
        yield Issue(
            ("rollout", "speculative"),
            "speculative decoding only speeds up rollouts, and a recipe without `task:` samples "
            "nothing (SFT); add a `task:` or drop rollout.speculative",
            "warning",
        )


@rule("rollout", "task")
def _staleness_needs_rollouts(r: RecipeSections) -> Iterator[Issue]:
    if r.rollout.max_staleness > 0 and r.task is None:
        yield Issue(
            ("rollout", "max_staleness"),
            "max_staleness lets rollouts run ahead of the trainer, and a recipe without `task:` "
            "samples nothing (SFT); add a `task:` or drop rollout.max_staleness",
            "warning",
        )


@rule("parallel", "resources")
def _world_size_matches(r: RecipeSections) -> Iterator[Issue]:
    world, p = r.resources.world_size, r.parallel
    if world is not None and world != p.world_size:
        yield Issue(
            ("resources", "world_size"),
            f"world_size {world} != tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp} = {p.world_size}",
        )


@rule("parallel")
def _ep_divides_dp(r: RecipeSections) -> Iterator[Issue]:
    p = r.parallel
    if p.dp % p.ep:
        yield Issue(
            ("parallel", "ep"),
            f"ep {p.ep} does not divide dp {p.dp}: expert parallelism splits the experts among "
            f"groups of ep data-parallel ranks; choose an ep that divides dp (or raise dp)",
        )


@rule("parallel", "resources", "rollout", "task")
def _local_ray_holds_the_actors(r: RecipeSections) -> Iterator[Issue]:
    res = r.resources
    if res.ray_address is not None:
        return  # a cluster's size is known when the run joins it (checked then)
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


@rule("trainer")
def _warmup_within_steps(r: RecipeSections) -> Iterator[Issue]:
    if r.trainer.warmup_steps > r.trainer.steps:
        yield Issue(
            ("trainer", "warmup_steps"),
            f"warmup_steps {r.trainer.warmup_steps} > steps {r.trainer.steps}: the learning "
            "rate never reaches trainer.lr",
            "warning",
        )


@rule("task")
def _task_prompts_and_reward(r: RecipeSections) -> Iterator[Issue]:
    task = r.task
    if task is None:
        return
    if task.verifiers_environment:
        yield from _verifiers_task(task)
        return
    if task.name == SEARCH_TASK or task.search is not None:
        yield from _search_task(task)
        return
    if (task.name is None) == (task.prompts is None):
        yield Issue(
            ("task",),
            "a task needs `name:` (a built-in task) or `prompts:` (a dataset), "
            + ("not both" if task.name else "and has neither"),
        )
    if task.reward is not None and task.rewards is not None:
        yield Issue(
            ("task", "rewards"),
            "a task sets `reward:` (one reward) or `rewards:` (several, by weight), not both",
        )
    elif task.effective_reward is None and task.rewards is None and task.environment is None:
        yield Issue(
            ("task",),
            "a task needs `reward:` (a built-in reward such as exact_answer, or "
            "`file.py:function`) or `rewards:`, unless its prompts come from reasoning-gym or "
            "its task.environment rewards every episode",
        )
    seen: set[str] = set()
    for i, term in enumerate(task.rewards or ()):
        if term.label in seen:
            yield Issue(
                ("task", "rewards", i, "name") if term.name else ("task", "rewards", i),
                f"a second reward named {term.label!r}: give each of task.rewards its own "
                "`name:` (its metric is reward/<name>)",
            )
        seen.add(term.label)


def _search_task(task: TaskSection) -> Iterator[Issue]:
    """Search-R1 (`name: search`): its prompts are a dataset, `search:` its retrieval, and its
    environment scores every episode (exact match), so no reward or environment of its own."""
    if task.name != SEARCH_TASK:
        yield Issue(
            ("task", "search"),
            "task.search configures the Search-R1 task: set task.name: search "
            + (f"(not {task.name!r})" if task.name else "beside it"),
        )
        return
    if task.search is None:
        yield Issue(
            ("task", "name"),
            "the search task needs `search: {corpus: <passages .jsonl/.parquet>, top_k, "
            "max_turns}` (or {endpoint: <your retrieval server>})",
        )
    if task.prompts is None:
        yield Issue(
            ("task", "name"),
            "the search task needs `prompts:` (a dataset of {question, answers} rows)",
        )
    for key in ("reward", "rewards", "environment"):
        if getattr(task, key) is not None:
            yield Issue(
                ("task", key),
                f"the search task's environment scores every episode (exact match against the "
                f"row's answers, reward/exact_match): remove task.{key}",
            )
    if "max_turns" in task.model_fields_set:
        yield Issue(
            ("task", "max_turns"),
            "the search task's turns are task.search.max_turns: move max_turns there",
        )


@rule("rollout", "task")
def _overlong_buffer_below_max_tokens(r: RecipeSections) -> Iterator[Issue]:
    buffer = r.task.overlong_buffer if r.task is not None else None
    if buffer is not None and buffer.tokens >= r.rollout.max_tokens:
        yield Issue(
            ("task", "overlong_buffer", "tokens"),
            f"overlong_buffer.tokens {buffer.tokens} must be below rollout.max_tokens "
            f"{r.rollout.max_tokens}: the penalty ramps over the last `tokens` tokens below it",
        )


@rule("rollout", "task")
def _truncation_mask_needs_rollouts(r: RecipeSections) -> Iterator[Issue]:
    if r.rollout.mask_truncated and r.task is None:
        yield Issue(
            ("rollout", "mask_truncated"),
            "mask_truncated filters truncated rollouts, and a recipe without `task:` samples "
            "nothing (SFT); add a `task:` or drop rollout.mask_truncated",
            "warning",
        )


@rule("rollout", "mask")
def _truncation_mask_needs_sampled_tokens(r: RecipeSections) -> Iterator[Issue]:
    if r.rollout.mask_truncated and r.mask == "all":
        yield Issue(
            ("rollout", "mask_truncated"),
            "mask_truncated takes truncated rollouts' sampled tokens off the loss, and mask: "
            "all trains every token regardless: use mask: sampled (or a roles table)",
        )


def _verifiers_task(task: TaskSection) -> Iterator[Issue]:
    """A verifiers taskset (task.environment: verifiers:...) gives the prompts and the
    rewards: a recipe that also names its own would have them silently unused."""
    owner = f"task.environment {task.environment}"
    for key in ("name", "prompts"):
        if getattr(task, key) is not None:
            yield Issue(
                ("task", key),
                f"{owner} gives the prompts (its taskset's tasks): remove task.{key}",
            )
    for key in ("reward", "rewards"):
        if getattr(task, key) is not None:
            yield Issue(
                ("task", key),
                f"{owner} scores every episode with its tasks' @vf.reward functions: remove "
                f"task.{key} (or add it to the taskset as a @vf.reward)",
            )


@rule("task")
def _sampling_rounds_need_dynamic_sampling(r: RecipeSections) -> Iterator[Issue]:
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


@rule("eval", "task")
def _eval_has_prompts(r: RecipeSections) -> Iterator[Issue]:
    if r.eval is None:
        return
    if r.task is None:
        yield Issue(("eval",), "`eval:` scores the policy with the task's reward and needs `task:`")
        return
    files = isinstance(r.task.prompts, DatasetSpec)  # reasoning-gym tasks draw eval prompts
    dataset = files or (r.task.name or "").endswith(DATA_FILE_SUFFIXES)
    held_out = files and r.task.prompts.heldout > 0
    if r.eval.prompts is None and dataset and not held_out:
        yield Issue(
            ("eval",),
            "no evaluation prompts: hold rows out of the task's dataset (task.prompts.heldout: "
            "N or a fraction) or give eval.prompts",
        )


# vLLM 0.32's largest max_lora_rank (`vllm.config.lora.MaxLoRARanks`; a test holds them equal).
VLLM_MAX_LORA_RANK = 512


@rule("model", "task")
def _lora_rank_served(r: RecipeSections) -> Iterator[Issue]:
    lora = r.model.lora
    if lora is not None and r.task is not None and lora.rank > VLLM_MAX_LORA_RANK:
        yield Issue(
            ("model", "lora", "rank"),
            f"the rollout engines serve the adapters with vLLM, which takes ranks up to "
            f"{VLLM_MAX_LORA_RANK} (max_lora_rank), not {lora.rank}: lower model.lora.rank",
        )


@rule("model", "losses")
def _lora_freezes_what_terms_train(r: RecipeSections) -> Iterator[Issue]:
    # Under LoRA only the decoder's adapters train: the MTP layers and a router are frozen.
    if r.model.lora is None:
        return
    for i, term in loss_terms(r):
        if term.kind == "mtp":
            yield Issue(
                ("losses", i, "kind"),
                "the mtp term trains the MTP layers, which model.lora leaves frozen (adapters go "
                "on the decoder's layers only): remove the term or model.lora",
            )
    for i, term in trunk_terms(r):
        yield Issue(
            ("losses", i, "kind"),
            f"{term.kind} trains the mixture-of-experts router, which model.lora leaves frozen: "
            "remove the term or model.lora",
        )
