"""The trainer: a Megatron-core policy, the fused head loss, torch.optim, weight export (and
a frozen teacher model when the plan distills).

One Trainer lives in each trainer process. With tensor parallelism each process holds its
shards and the head loss runs vocab-parallel over the TP group; every process of a TP group
gets the same micro batches. With pipeline parallelism each process holds one stage's layers,
the micro batches flow through the stages on Megatron-core's 1F1B schedule and the last stage
runs the head loss (and the teacher). With context parallelism each process of a group runs
its share of every micro batch's tokens and attention gathers the others' keys and values.
Data-parallel replicas get different micro batches. Each micro batch (each rank's share of
it) is weighted by its share of the step's trained tokens and gradients are summed over
replicas and context-parallel ranks, so the step equals one process stepping over all of
the micro batches.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mtprun.compiler import HeadPlan
from mtprun.data.batch import PackedBatch
from mtprun.kernels.output import HeadLossOutput
from mtprun.models import ModelShape, ep_layout, megatron_to_hf
from mtprun.models.lora import is_adapter, merge_lora, peft_name
from mtprun.models.pp_layout import (
    PipelineStage,
    copies_mtp_embedding,
    is_tied_copy,
    splits_tied_embedding,
)
from mtprun.runner.trainer import whole_model
from mtprun.runner.trainer.context_parallel import TokenShard, gather_row
from mtprun.runner.trainer.fits import refuse_what_cannot_fit
from mtprun.runner.trainer.lora import attach_lora
from mtprun.runner.trainer.micro_batches import as_many_as_expert_ranks, trained_sequences
from mtprun.runner.trainer.mixed_precision import MegatronMixedPrecision
from mtprun.runner.trainer.model import (
    MTP_PREFIX,
    MoEOptions,
    load_policy_model,
    sum_partial_grads,
)
from mtprun.runner.trainer.optim import NormScope, build_groups, load_optimizer_state
from mtprun.runner.trainer.parallel import ensure_parallel
from mtprun.runner.trainer.pipeline import run_micro_batches
from mtprun.runner.trainer.replay import ReplayRouting, routed_experts_of
from mtprun.runner.trainer.routing import RouterStats
from mtprun.runner.trainer.teacher import Teacher
from mtprun.spec.recipe import Recipe

log = logging.getLogger("mtprun")


class Trainer:
    """Train the policy of `model_dir` (an HF folder) on packed batches with `plan`.

    Call `mtprun.runner.trainer.parallel.init_parallel` in every trainer process first; a
    single-process recipe (tp=pp=cp=dp=1) is initialised here when nobody did.
    """

    def __init__(self, recipe: Recipe, model_dir: Path, plan: HeadPlan, device: Any) -> None:
        self.recipe = recipe
        self.plan = plan
        self.device = torch.device(device)
        self._compute_dtype = getattr(torch, recipe.model.dtype)
        if self._compute_dtype != torch.float32 and self.device.type != "cuda":
            # Megatron's linear layers declare their autocast behaviour for CUDA only.
            raise ValueError(
                f"model.dtype: {recipe.model.dtype} trains under autocast, which Megatron-core "
                "supports on CUDA devices only; use model.dtype: float32 on CPU"
            )
        refuse_what_cannot_fit(recipe, plan, self.device)
        _check_context_parallel(plan, recipe.parallel.cp)
        ensure_parallel(recipe.parallel, recipe.seed)
        self._join_parallel_groups(plan)
        self.shape = ModelShape.from_model_dir(model_dir)
        _check_mtp_layers(self.shape, plan, model_dir)
        self.stage = PipelineStage(
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            self.shape.layers,
        )
        self._load_model(recipe, Path(model_dir), plan)
        self.routing = RouterStats(self.model, self.ep_size) if self.shape.experts else None
        if recipe.trainer.router_replay and not self.shape.experts:
            raise ValueError(
                "trainer.router_replay replays the routing of a mixture-of-experts model, and "
                f"{model_dir} is dense"
            )
        # Rollout tokens route to the engine's experts (trainer.router_replay).
        self.replay = (
            ReplayRouting(self.model, self.shape.layers) if recipe.trainer.router_replay else None
        )
        self.step = 0
        self._logprob_plan = HeadPlan.from_losses([{"kind": "ce"}], tp_size=self.tp_size)

    def _join_parallel_groups(self, plan: HeadPlan) -> None:
        """This rank's tensor / data / context-parallel sizes and groups (Megatron's)."""
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_group = (
            parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        )
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        if plan.tp_size != self.tp_size:
            raise ValueError(
                f"the HeadPlan was compiled for tp_size={plan.tp_size} but parallel.tp="
                f"{self.tp_size}; compile it from the same recipe"
            )

    def _load_model(self, recipe: Recipe, model_dir: Path, plan: HeadPlan) -> None:
        """This rank's part of the policy (with its LoRA adapters), the distillation
        teacher, the optimizer's parameter groups (or Megatron's mixed precision) and the
        scope of the gradient norm."""
        tp = (parallel_state.get_tensor_model_parallel_rank(), self.tp_size)
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        ep = (parallel_state.get_expert_model_parallel_rank(), self.ep_size)
        self.shape.check_ep(self.ep_size)
        mtp = plan.term("mtp")
        separate = {"mtp": MTP_PREFIX} if mtp is not None and mtp.separate_optimizer else None
        # bf16 weights with Megatron's DDP and optimizer where they can run (see
        # mixed_precision); float32 weights under autocast with torch.optim elsewhere.
        mixed = self._compute_dtype == torch.bfloat16 and self.device.type == "cuda"
        mixed = mixed and separate is None
        weights = torch.bfloat16 if mixed else torch.float32
        self.model = load_policy_model(
            model_dir,
            self.shape,
            self.device,
            *tp,
            self.stage,
            recipe.trainer.recompute,
            weights,
            ep=ep,
            moe=moe_options(recipe),
        )
        self.model.freeze_mtp_layers_beyond(plan.mtp_depth)
        if recipe.model.lora is not None:  # base frozen, adapters train (trainer/lora.py)
            attach_lora(self.model, recipe.model.lora, *tp, seed=recipe.seed)
        distill = plan.term("distill")
        self.teacher = (
            Teacher(Path(distill.teacher), self.shape, self.device, *tp, weights)
            if distill is not None and self.stage.last
            else None
        )
        names = [n for n, _ in self.model.named_parameters()]
        copies = frozenset(n for n in names if is_tied_copy(n, self.shape, self.stage))
        self.mixed = (
            MegatronMixedPrecision(
                recipe.trainer,
                self.model,
                copies,
                # the stages' gradients of a split tied embedding are summed after the backward
                overlap_grad_reduce=not splits_tied_embedding(self.shape, self.stage),
            )
            if mixed
            else None
        )
        self.groups = [] if mixed else build_groups(recipe.trainer, self.model, separate)
        self._norm_scope = NormScope(
            tp=self.tp_group,
            pp=parallel_state.get_pipeline_model_parallel_group() if self.stage.size > 1 else None,
            ep=parallel_state.get_expert_model_parallel_group() if self.ep_size > 1 else None,
            copies=copies,
        )

    def train_step(self, micro_batches: list[PackedBatch]) -> dict[str, float]:
        """Accumulate gradients over the micro batches, then one clipped optimizer step.

        Each micro batch's loss is weighted by its share of the step's trained tokens over
        all data-parallel replicas, and replica gradients are summed, so the step equals one
        process training on every micro batch: the token-mean over the whole step. Returns
        the loss, every metric of the plan (same weighting), grad_norm (before clipping), lr
        (of this step), tokens and trained_tokens (of the whole step). With
        `mtp.separate_optimizer` the MTP layers are clipped and stepped on their own, and
        grad_norm is the policy's alone (the MTP head's is mtp/grad_norm). Under pipeline
        parallelism the loss and metrics are the last stage's (0 on the others).
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro batch")
        self.model.train()
        self._zero_grad()
        if self.replay is not None:
            self.replay.begin_step()
        trained = [int(mb.loss_mask.sum()) for mb in micro_batches]
        tokens, total, sequences = self._sum_over_data_parallel(
            [
                sum(mb.num_tokens for mb in micro_batches),
                sum(trained),
                sum(trained_sequences(mb) for mb in micro_batches),
            ]
        )
        # The padding adds no token to the step's counts above.
        micro_batches = self._as_many_as_expert_ranks(micro_batches)
        trained += [0] * (len(micro_batches) - len(trained))
        # Sequence means (seq-mean-* aggregations) over the step's sequences: each micro
        # batch counts its sequences at the step's rate (HeadInputs.build tokens_per_sequence).
        rate = total / max(sequences, 1)
        # Each micro batch's loss is the token mean over this rank's share of its tokens,
        # so it weighs by that share's trained tokens; the context-parallel ranks' shares
        # add up to the micro batch. A micro batch without trained tokens teaches nothing;
        # every rank of its replica skips it alike (shares of it may be empty on some ranks
        # only), but not under expert parallelism, where other replicas' ranks exchange
        # tokens with it at every MoE layer: it runs there, at weight 0.
        exchanged = self.ep_size > 1 and total > 0
        shares = [
            (mb, int(self._shard(mb).local_sum(mb.loss_mask)) / total, rate)
            for mb, count in zip(micro_batches, trained, strict=True)
            if count or exchanged
        ]
        reports = run_micro_batches(self.model, shares, self._train_micro_batch)
        sums: dict[str, Any] = dict.fromkeys(("loss", *self.plan.metrics), 0.0)
        for report in reports:
            for name, value in report.items():
                sums[name] = sums[name] + value
        sums = dict(zip(sums, _read_floats(list(sums.values())), strict=True))
        self._sum_tied_embedding_grads()
        lr, norms = self._optimizer_step(backward_ran=bool(shares))
        self._refresh_mtp_embedding()
        self.step += 1
        summed = self._sum_over_data_parallel(list(sums.values()), with_context=True)
        metrics = dict(zip(sums, summed, strict=True))
        metrics.update(self._routing_metrics())
        metrics["grad_norm"] = norms.pop("policy")
        metrics.update({f"{name}/grad_norm": norm for name, norm in norms.items()})
        return {**metrics, "lr": lr, "tokens": tokens, "trained_tokens": total}

    def _routing_metrics(self) -> dict[str, float]:
        """The step's MoE routing metrics (`RouterStats`), reduced over the ranks that route
        their own tokens: data-parallel, context-parallel and (`TensorParallelMoELayer`)
        tensor-parallel ones."""
        if self.routing is None:
            return {}
        group = None
        if self.dp_size * self.cp_size * self.tp_size > 1:
            group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        values = self.routing.step_metrics(group)
        return dict(zip(values, _read_floats(list(values.values())), strict=True))

    @torch.no_grad()
    def logprobs(self, batches: list[PackedBatch]) -> list[torch.Tensor]:
        """Per batch, the [T] log-prob of each target under the current policy, 0 where
        loss_mask is False (for old and reference log-probs). Only the last pipeline stage
        has them; the other stages return []. Under expert parallelism the batches are
        padded to the expert-parallel group's count (`as_many_as_expert_ranks`) and the
        padding's log-probs dropped."""
        self.model.eval()
        padded = self._as_many_as_expert_ranks(batches)
        reports = run_micro_batches(self.model, padded, self._logprob_micro_batch, True)
        if not reports:
            return []
        return [
            self._gather_row(report["logprobs"], self._shard(batch))
            for batch, report in zip(batches, reports[: len(batches)], strict=True)
        ]

    def _as_many_as_expert_ranks(self, batches: list[PackedBatch]) -> list[PackedBatch]:
        """`batches` padded to the expert-parallel group's count, if there is one to pad."""
        if self.ep_size == 1 or not batches:
            return batches
        group = parallel_state.get_expert_model_parallel_group()
        return as_many_as_expert_ranks(batches, group, self.device)

    def hf_state_dict(self, root_only: bool = False) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (gathered over TP, EP and pipeline stages) for vLLM weight
        sync and HF export; with LoRA the adapters merged into their weights. With
        `root_only` rank 0 alone gets them (the others {}). Every process of the
        model-parallel group must call it (it gathers)."""
        local = whole_model.model_tensors(self.model)
        full = whole_model.gather_whole_model(local, self.shape, self.stage, root_only)
        if not full:
            return {}
        if self.recipe.model.lora is not None:  # merged: W + scaling B A
            full = merge_lora(full, self.shape, self.recipe.model.lora.scaling)
        return megatron_to_hf(full, self.shape)

    def hf_state_dict_chunks(
        self, root_only: bool = False, layers: int = whole_model.LAYERS_PER_PART
    ) -> Iterator[dict[str, torch.Tensor]]:
        """`hf_state_dict` `layers` decoder layers at a time (`whole_model_chunks`; with LoRA,
        or under pipeline parallelism, in one part). Every process of the gather takes all."""
        if self.recipe.model.lora is not None:
            return iter([self.hf_state_dict(root_only)])
        convert = partial(megatron_to_hf, shape=self.shape)
        local = whole_model.model_tensors(self.model)
        chunks = whole_model.whole_model_chunks
        return chunks(local, self.shape, self.stage, root_only, convert, layers)

    def adapter_state_dict(self, root_only: bool = False) -> dict[str, torch.Tensor]:
        """The LoRA adapters alone, whole (gathered as `hf_state_dict` gathers) and under
        PEFT's names (`mtprun.models.lora.peft_name`), as `adapter_model.safetensors` holds
        them. Every process of the model-parallel group must call it (it gathers)."""
        local = {n: t for n, t in self.model.state_dict().items() if is_adapter(n)}
        full = whole_model.gather_whole_model(local, self.shape, self.stage, root_only)
        return {peft_name(n): t for n, t in full.items()}

    def _zero_grad(self) -> None:
        if self.mixed is not None:
            self.mixed.zero_grad()
        for group in self.groups:
            group.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self, backward_ran: bool) -> tuple[float, dict[str, float]]:
        """Sum the gradients over data-parallel and context-parallel ranks, clip and step;
        returns this step's learning rate and each optimizer's norm before clipping."""
        if self.mixed is not None:
            self.mixed.finish_grads(backward_ran)
            sum_partial_grads(self.model, self.tp_group)
            lr = self.mixed.lr
            return lr, {"policy": self.mixed.step()}
        self._sum_data_parallel_grads()
        sum_partial_grads(self.model, self.tp_group)
        lr = self.groups[0].lr
        clip = self.recipe.trainer.grad_clip
        return lr, {g.name: g.step(clip, self._norm_scope) for g in self.groups}

    def _optimizers(self) -> dict[str, Any]:
        """name -> (optimizer, lr schedule) for checkpoints; the mixed-precision one carries
        its schedule's position itself."""
        if self.mixed is not None:
            return {"policy": (self.mixed, None)}
        return {g.name: (g.optimizer, g.scheduler) for g in self.groups}

    def state_dict(self) -> dict[str, Any]:
        """This process's model shards (with LoRA its adapters alone: the frozen base is the
        folder the stage starts from), optimizer, scheduler and step (for checkpoints).
        Like torch's state_dict it references live tensors: save or copy it before stepping."""
        model = self.model.state_dict()
        if self.recipe.model.lora is not None:
            model = {name: t for name, t in model.items() if is_adapter(name)}
        return {
            "model": model,
            "optimizers": {n: opt.state_dict() for n, (opt, _) in self._optimizers().items()},
            "schedulers": {
                n: sched.state_dict() for n, (_, sched) in self._optimizers().items() if sched
            },
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, optimizers = sorted(state["optimizers"]), self._optimizers()
        if saved != sorted(optimizers):
            raise ValueError(
                f"the checkpoint has optimizers {saved} but this recipe makes "
                f"{sorted(optimizers)}; was mtp.separate_optimizer changed?"
            )
        if self.recipe.model.lora is None:
            self.model.load_state_dict(state["model"])
        else:  # the adapters; the base is the one this trainer loaded
            loaded = self.model.load_state_dict(state["model"], strict=False)
            missing = [name for name in loaded.missing_keys if is_adapter(name)]
            if missing or loaded.unexpected_keys:
                raise ValueError(
                    f"the checkpoint's adapters do not fit this recipe's model.lora: missing "
                    f"{missing[:3]}, unexpected {loaded.unexpected_keys[:3]}; was model.lora "
                    "changed?"
                )
        for name, (optimizer, scheduler) in optimizers.items():
            load_optimizer_state(name, optimizer, state["optimizers"][name])
            if scheduler is not None:
                scheduler.load_state_dict(state["schedulers"][name])
        self.step = int(state["step"])

    def _train_micro_batch(self, item: tuple[PackedBatch, float, float]) -> Any:
        """Pipeline step of train_step: the loss weighted by the micro batch's share of the
        step's trained tokens, and the loss and metrics so weighted (the step's trained tokens
        per trained sequence come along for the sequence means)."""
        batch, share, tokens_per_sequence = item
        if self.routing is not None:
            tokens = int(self._shard(batch).index.numel())
            self.routing.weigh_micro_batch(share, tokens)
        out = self._stage_forward(batch, self.plan, tokens_per_sequence, grad_scale=share)
        if not isinstance(out, HeadLossOutput):
            return out
        # Detached device scalars: reading them here would stall the GPU before backward.
        report = {"loss": share * out.loss.detach()}
        report.update({name: share * value for name, value in out.metrics.items()})
        return out.loss * share, report

    def _logprob_micro_batch(self, batch: PackedBatch) -> Any:
        out = self._stage_forward(batch, self._logprob_plan)
        if not isinstance(out, HeadLossOutput):
            return out
        return out.loss, {"logprobs": out.logprobs.float().cpu()}

    def _stage_forward(
        self,
        batch: PackedBatch,
        plan: HeadPlan,
        tokens_per_sequence: float | None = None,
        grad_scale: float | None = None,
    ) -> torch.Tensor | HeadLossOutput:
        """This stage's layers on this rank's share of the tokens; on the last stage, the
        fused head loss on their output (tokens_per_sequence: see HeadInputs.build).
        `batch` on the host: its boundaries stay there for the model (no device read back).
        `grad_scale`: the factor the caller back-propagates the loss with, when it will: a
        float32 main_grad of the output layer then takes the layer's gradient directly."""
        from mtprun.kernels import HeadInputs, head_loss

        host_cu_seqlens = batch.cu_seqlens
        batch = batch.to(self.device)
        shard = self._shard(batch)
        local = shard.take(batch)
        # The attention mask needs the whole row's sequences, the rest the local tokens.
        inputs = (local.input_ids, local.position_ids, host_cu_seqlens)
        teacher: dict[str, torch.Tensor] = {}
        with self._autocast(), self._replaying(batch, shard):
            if not self.stage.last:
                return self.model.stage_hidden(*inputs, shard=shard)
            targets = local.targets if plan.mtp_depths else None
            hidden, mtp_hidden = self.model.hidden_states(*inputs, targets=targets, shard=shard)
            if plan.term("distill") is not None:
                teacher = self.teacher.outputs(*inputs, shard=shard)
        weight = self.model.output_weight().to(hidden.dtype)
        takes_grad = grad_scale is not None and weight.requires_grad
        main_grad = getattr(weight, "main_grad", None) if takes_grad else None
        head_inputs = HeadInputs.build(
            plan,
            hidden,
            weight,
            targets=local.targets,
            loss_mask=local.loss_mask,
            advantages=local.advantages,
            old_logprobs=local.old_logprobs,
            ref_logprobs=local.ref_logprobs,
            sampler_logprobs=local.sampler_logprobs if plan.sampler_logprobs else None,
            tokens_per_sequence=tokens_per_sequence,
            mtp_hidden=mtp_hidden[: len(plan.mtp_depths)] or None,
            cu_seqlens=local.cu_seqlens,
            tp_group=self.tp_group,
            weight_main_grad=main_grad,
            weight_grad_scale=1.0 if grad_scale is None else grad_scale,
            **teacher,
        )
        return head_loss(head_inputs)

    def _replaying(
        self, batch: PackedBatch, shard: TokenShard
    ) -> contextlib.AbstractContextManager:
        """Router replay of the batch's rollout routing on this rank's tokens, when the recipe
        asks for it and the batch has one (rollout batches; SFT batches have none)."""
        if self.replay is None:
            return contextlib.nullcontext()
        index = shard.index if self.cp_size > 1 else None
        return self.replay.replaying(routed_experts_of(batch, index))

    def _autocast(self) -> contextlib.AbstractContextManager:
        """float32 weights computing in bf16 run under autocast; bf16 weights (mixed) need
        none: every activation, the residual stream included, is bf16 already."""
        if self._compute_dtype == torch.float32 or self.mixed is not None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._compute_dtype)

    def _sum_tied_embedding_grads(self) -> None:
        """A tied model split over stages holds the embedding on the first stage and a copy
        as the output layer on the last: both take the sum of their gradients."""
        if not splits_tied_embedding(self.shape, self.stage):
            return
        if not (self.stage.first or self.stage.last):
            return
        weight = (
            self.model.embedding.word_embeddings.weight
            if self.stage.first
            else self.model.output_layer.weight
        )
        if self.mixed is not None:  # DDP accumulates into float32 main_grad
            dist.all_reduce(weight.main_grad, group=parallel_state.get_embedding_group())
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    @torch.no_grad()
    def _refresh_mtp_embedding(self) -> None:
        """An untied model split over stages keeps a frozen embedding copy beside its MTP
        layers on the last stage: it takes the first stage's stepped embedding."""
        if not copies_mtp_embedding(self.shape, self.stage):
            return
        if not (self.stage.first or self.stage.last):
            return
        weight = self.model.embedding.word_embeddings.weight
        dist.broadcast(weight, group=parallel_state.get_embedding_group(), group_src=0)

    def _sum_data_parallel_grads(self) -> None:
        """Replicas and context-parallel ranks each hold part of the step's gradient. The
        routed experts' gradients are summed over megatron-core's expert-data-parallel group
        instead: the ranks that hold the same experts (ep) and route their own tokens to them
        (data-parallel replicas, and under tp each tensor-parallel rank, see
        `TensorParallelMoELayer`)."""
        dense = self.dp_size * self.cp_size > 1
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        experts = None
        if self.shape.experts is not None:
            experts = parallel_state.get_expert_data_parallel_group()
            experts = experts if dist.get_world_size(experts) > 1 else None
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            if ep_layout.is_expert(name):
                if experts is not None:
                    dist.all_reduce(p.grad, group=experts)
            elif dense:
                dist.all_reduce(p.grad, group=group)

    def _sum_over_data_parallel(self, values: list[Any], with_context: bool = False) -> list[Any]:
        """Element-wise sum over data-parallel replicas, and over context-parallel ranks too
        when `with_context` (for values of each rank's share of the tokens); ints stay ints."""
        if self.dp_size * (self.cp_size if with_context else 1) == 1:
            return values
        dtype = torch.int64 if all(isinstance(v, int) for v in values) else torch.float64
        summed = torch.tensor(values, dtype=dtype, device=self.device)  # NCCL: device tensors
        group = parallel_state.get_data_parallel_group(with_context_parallel=with_context)
        dist.all_reduce(summed, group=group)
        return summed.tolist()

    def _shard(self, batch: PackedBatch) -> TokenShard:
        return TokenShard(self.cp_rank, self.cp_size, batch.num_tokens)

    def _gather_row(self, local: torch.Tensor, shard: TokenShard) -> torch.Tensor:
        """[T_local] values of this rank's tokens -> [T] of the whole row (context-parallel
        ranks all call it)."""
        if self.cp_size == 1:
            return local
        group = parallel_state.get_context_parallel_group()
        return gather_row(local.to(self.device), shard, group)


def moe_options(recipe: Recipe) -> MoEOptions:
    """The recipe's expert parallelism and router trunk-loss coefficients."""
    coefs = {t.kind: t.weight for t in recipe.losses if t.kind in ("router_aux", "router_z")}
    return MoEOptions(
        ep=recipe.parallel.ep,
        aux_loss_coef=coefs.get("router_aux", 0.0),
        z_loss_coef=coefs.get("router_z", 0.0),
    )


def _check_mtp_layers(shape: ModelShape, plan: HeadPlan, model_dir: Path) -> None:
    """Refuse mtp terms deeper than the MTP layers the trainer builds; say when the folder's
    config.json declares MTP layers whose tensors its weights lack (none is built then)."""
    depth = plan.mtp_depth
    if shape.absent_mtp_layers:
        missing = ", ".join(shape.missing_mtp_tensors[:4])
        why = (
            f"{model_dir}'s config.json declares {shape.absent_mtp_layers} MTP layer(s) "
            f"({shape.mtp_layers_key}) but its weights hold none of their tensors ({missing}, "
            "...; transformers drops the MTP layer)"
        )
        if depth:
            raise ValueError(
                f"losses: an mtp term trains the model's MTP layers, and {why}: start from a "
                "folder that holds the MTP layer, or remove the mtp term"
            )
        log.info("%s: the MTP layers are not built; exports carry config.json as read", why)
    if depth > shape.mtp_layers:
        raise ValueError(
            f"losses: an mtp term of depth {depth} needs a model with at least that many MTP "
            f"layers, and {model_dir} has {shape.mtp_layers} (set model.tiny.architecture: "
            "mimo and model.tiny.mtp_layers)"
        )


def _check_context_parallel(plan: HeadPlan, cp: int) -> None:
    """Under context parallelism a rank holds pieces of sequences: what needs whole ones is
    refused (the recipe rules say the same)."""
    if cp == 1:
        return
    if plan.mtp_depths:
        raise ValueError(
            f"losses: mtp terms need parallel.cp: 1 (it is {cp}): a draft row t is taught by "
            "the policy's row t+k, which may sit on another context-parallel rank"
        )
    if plan.sequence_ratio:
        raise ValueError(
            f"losses: the grpo term's ratio 'sequence' (GSPO) needs whole sequences and "
            f"parallel.cp={cp} splits them; use ratio: token"
        )
    for term in plan.terms:
        if term.loss_agg != "token-mean":
            raise ValueError(
                f"losses: the {term.kind} term's loss_agg {term.loss_agg!r} needs whole "
                f"sequences and parallel.cp={cp} splits them; use loss_agg: token-mean"
            )


def _read_floats(values: list[float | torch.Tensor]) -> list[float]:
    """The values as floats, the device scalars among them read in one transfer."""
    tensors = [v.double() for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
