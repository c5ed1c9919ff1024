"""The trainer's model: a Megatron-core GPTModel (local layer spec) plus MTP layers,
one pipeline stage of it per process.

`PolicyModel.hidden_states` is the last stage's forward. It returns the final (normed) hidden
states for the fused head loss, which applies the output layer itself, so Megatron's own
logits and loss are never computed; earlier stages run `stage_hidden`. Packed sequences:
position ids restart at every sequence start and are used to index the rotary table, and
attention is block-diagonal causal over `cu_seqlens` (`mtprun.runner.trainer.attention`: a
FlexAttention block mask on CUDA, an explicit boolean mask on CPU). Under context parallelism
each process runs its share of the tokens and the core attention gathers the keys and values
of the others (`context_parallel`). A hybrid model (Qwen3.5) gets its layer spec per layer
index: Gated DeltaNet layers (`gated_delta_net.PackedGatedDeltaNet`, which read the row's
`cu_seqlens` from `PackedRows`) between gated attention layers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.spec_utils import build_module
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from mtprun.kernels.gated_delta import require_gdn_kernels
from mtprun.models import hf_to_megatron
from mtprun.models.expert_shape import ExpertShape
from mtprun.models.families import family_of
from mtprun.models.pp_layout import PipelineStage, holds_mtp_embedding
from mtprun.models.shape import ModelShape
from mtprun.runner.trainer.attention import PackedRows, packed_attention_mask
from mtprun.runner.trainer.context_parallel import TokenShard
from mtprun.runner.trainer.gated_delta_net import ZeroCenteredRMSNorm
from mtprun.runner.trainer.layer_specs import decoder_layer_spec, stage_layer_specs

Recompute = Literal["none", "selective", "full"]


def transformer_config(
    shape: ModelShape,
    pp: int = 1,
    recompute: Recompute = "none",
    dtype: torch.dtype = torch.float32,
    fused: bool = False,
    moe: MoEOptions | None = None,
) -> TransformerConfig:
    """Megatron config for a Qwen2-style decoder split into `pp` pipeline stages, with
    `dtype` weights, and the layer options of the shape's family (q/k norms); fusions that need
    Transformer Engine or Apex off.

    `fused` (CUDA) runs the MLP's SwiGLU as one Triton kernel each way
    (`layer_specs.SwiGLUActivation`, taken through Megatron's module-activation hook
    `use_te_activation_func`, which builds the layer spec's `activation_func`) instead of a
    strided kernel per op over the [T, 2 ffn] activation. CPUs keep the eager ops (tiny sizes).

    `recompute: selective` is Megatron-core's selective recomputation of each layer's MLP:
    its largest activations (2 x ffn + ffn per token) go, attention's stay. Core attention is
    left out: the packed attention keeps only q, k, v, its output and row statistics, so
    recomputing it would save little. So are the norms: megatron-core 0.16's output-discarding
    checkpoint needs Transformer Engine. `full` is applied by the model's layer loop
    (`PolicyModel._run_layers`).

    A mixture-of-experts shape adds megatron-core's MoE options (`moe_config_options`).
    """
    selective = recompute == "selective"
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.intermediate,
        add_qkv_bias=shape.qkv_bias,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # bf16 weights train with Megatron's optimizer (float32 master copies there); float32
        # weights are their own master copy and compute under autocast.
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights come from the HF checkpoint
        bias_activation_fusion=False,
        use_te_activation_func=fused,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        pipeline_model_parallel_size=pp,
        # Stages exchange float32 hidden states (the residual stream's dtype under autocast
        # too) by plain isend/irecv pairs.
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
        # The trainer weights each micro batch's loss itself (its share of the step's tokens).
        calculate_per_token_loss=True,
        recompute_granularity="selective" if selective else None,
        recompute_modules=["mlp"] if selective else None,
        **shape.megatron_layer_options(),
        **moe_config_options(shape, moe or MoEOptions()),
    )
    # Shapes go first: packed micro batches differ in length. Set after construction because
    # the config's check of MoE token dispatchers refuses it even for a model without experts.
    config.variable_seq_lengths = True
    return config


@dataclass(frozen=True)
class MoEOptions:
    """How the trainer runs a mixture-of-experts model: `ep` expert-parallel ranks, and the
    router's trunk losses (load-balancing `aux_loss_coef`, router `z_loss_coef`; 0: off)."""

    ep: int = 1
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0


def moe_config_options(shape: ModelShape, moe: MoEOptions) -> dict[str, Any]:
    """megatron-core's TransformerConfig fields for `shape.experts` (none for a dense shape).

    The router maps onto megatron-core's TopKRouter: softmax scores renormalised over the
    top k equal a softmax over the top-k logits (`moe_router_pre_softmax` off); without
    renormalisation the softmax runs over every expert first. Sigmoid scores with a
    correction bias are its `moe_router_enable_expert_bias` (the bias only chooses, and the
    trainer never updates it: it is the checkpoint's). Tokens move with
    `RankDedupDispatcher` (TensorParallelMoELayer sets it in place of the all-to-all
    dispatcher megatron-core builds from this config); the experts are `GroupedExperts`.
    Routing runs in float32.
    """
    experts = shape.experts
    if experts is None:
        return {}
    _check_router_maps(experts)
    return {
        "num_moe_experts": experts.count,
        "moe_router_topk": experts.top_k,
        "moe_ffn_hidden_size": experts.intermediate,
        "moe_router_score_function": experts.score,
        "moe_router_pre_softmax": experts.score == "softmax" and not experts.normalize_top_k,
        "moe_router_topk_scaling_factor": experts.scaling if experts.scaling != 1.0 else None,
        "moe_router_num_groups": experts.groups if experts.groups > 1 else None,
        "moe_router_group_topk": experts.group_top_k if experts.groups > 1 else None,
        "moe_router_enable_expert_bias": experts.score_bias,
        "moe_router_bias_update_rate": 0.0,
        "moe_shared_expert_intermediate_size": experts.shared_intermediate or None,
        "moe_token_dispatcher_type": "alltoall",
        "moe_router_load_balancing_type": "aux_loss" if moe.aux_loss_coef else "none",
        "moe_aux_loss_coeff": moe.aux_loss_coef,
        "moe_z_loss_coeff": moe.z_loss_coef or None,
        "moe_router_dtype": "fp32",
        "expert_model_parallel_size": moe.ep,
        # Experts are never split over tp (GroupedExperts holds whole experts); under tp each
        # rank routes its own share of the tokens (TensorParallelMoELayer).
        "expert_tensor_parallel_size": 1,
    }


def _check_router_maps(experts: ExpertShape) -> None:
    """Refuse routers that megatron-core's TopKRouter computes differently from the HF
    model: it always renormalises sigmoid scores over the top k, and ranks each expert group
    by its best top_k / group_top_k scores (DeepSeek-V3 and GLM-4.5 rank by the best 2)."""
    if experts.score == "sigmoid" and experts.top_k > 1 and not experts.normalize_top_k:
        raise ValueError(
            "a sigmoid router without norm_topk_prob is not supported: megatron-core's router "
            "renormalises the chosen scores"
        )
    if experts.groups > 1 and experts.top_k // experts.group_top_k != 2:
        raise ValueError(
            f"grouped top-k with num_experts_per_tok {experts.top_k} and topk_group "
            f"{experts.group_top_k} is not supported: megatron-core ranks groups by their best "
            f"{experts.top_k // experts.group_top_k} scores and the HF model by their best 2"
        )


class MTPLayer(torch.nn.Module):
    """One MTP layer: input_proj([norm(emb(next token)), norm(trunk hidden)]) with the
    embedding first (DeepSeek-V3, GLM-4.5, Qwen3.5), or [hidden, embedding] (MiMo) -> one
    decoder layer (sparse when `experts`) -> final norm. Same input order and position-0
    masking as vLLM's drafters of those families, so trained weights serve speculative
    decoding unchanged. Its router (if any) adds no trunk loss: the draft head trains on the
    decoupled `mtp` term alone. `zero_centered_norm`: its norms apply (1 + w) (Qwen3.5)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        embedding_first: bool = False,
        experts: int | None = None,
        zero_centered_norm: bool = False,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layernorm_epsilon

        def norm() -> torch.nn.Module:
            if zero_centered_norm:
                return ZeroCenteredRMSNorm(config, hidden, eps)
            return torch.nn.RMSNorm(hidden, eps=eps)

        self.embedding_first = embedding_first
        self.token_layernorm = norm()
        self.hidden_layernorm = norm()
        # Replicated over TP ranks: its inputs and output gradients are identical on each.
        self.input_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        if experts is not None:
            config = copy.copy(config)
            config.moe_router_load_balancing_type, config.moe_aux_loss_coeff = "none", 0.0
            config.moe_z_loss_coeff = None
        self.decoder_layer = build_module(
            decoder_layer_spec(config.qk_layernorm, experts, zero_centered_norm),
            config=config,
            layer_number=layer_number,
        )
        self.final_layernorm = norm()

    def forward(
        self,
        hidden: torch.Tensor,
        token_emb: torch.Tensor,
        rows: PackedRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, H] inputs -> (output before the final norm, output after it)."""
        parts = [self.hidden_layernorm(hidden), self.token_layernorm(token_emb)]
        joint = torch.cat(parts[::-1] if self.embedding_first else parts, -1)
        out, _ = self.decoder_layer(hidden_states=self.input_proj(joint), attention_mask=rows)
        return out, self.final_layernorm(out)


MTP_PREFIX = "mtp_layers."  # parameter names of the MTP head


class PolicyModel(GPTModel):
    """One pipeline stage of a GPTModel, with optional MTP layers under `mtp_layers.{i}.`
    on the last stage (the whole model when the stage is the only one)."""

    def __init__(
        self,
        shape: ModelShape,
        stage: PipelineStage | None = None,
        recompute: Recompute = "none",
        dtype: torch.dtype = torch.float32,
        fused: bool = False,
        moe: MoEOptions | None = None,
    ) -> None:
        stage = stage or PipelineStage(0, 1, shape.layers)
        config = transformer_config(shape, stage.size, recompute, dtype, fused, moe)
        super().__init__(
            config=config,
            transformer_layer_spec=stage_layer_specs(shape, stage),
            vocab_size=shape.vocab,
            max_sequence_length=shape.max_seq_len,
            pre_process=stage.first,
            post_process=stage.last,
            # Split over stages, a tied model's output layer is a copy (see pp_layout).
            share_embeddings_and_output_weights=shape.tie_embeddings and stage.size == 1,
            position_embedding_type="rope",
            rotary_percent=shape.rotary_fraction,
            rotary_base=int(shape.rope_theta),
        )
        self.shape = shape
        self.stage = stage
        self.recompute = recompute
        mtp_layers = shape.mtp_layers if stage.last else 0
        family = family_of(shape.architecture) if shape.architecture else None
        self.family = family
        experts = shape.experts.count if shape.experts else None
        self.mtp_layers = torch.nn.ModuleList(
            MTPLayer(
                config,
                layer_number=shape.layers + i + 1,
                embedding_first=bool(family and family.mtp_embedding_first),
                experts=experts,
                zero_centered_norm=shape.zero_centered_norm,
            )
            for i in range(mtp_layers)
        )
        if holds_mtp_embedding(shape, stage):
            self._add_mtp_embedding()
        check_native_mtp_loss_disabled(self)

    def _add_mtp_embedding(self) -> None:
        """The MTP layers' token embedding on a last stage that is not the first (see
        pp_layout): a tied model's output layer, else a frozen copy that the trainer refreshes
        from the first stage. The MTP lookups run without gradient either way."""
        self.embedding = LanguageModelEmbedding(
            config=self.config,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            position_embedding_type="rope",
            tp_group=self.pg_collection.tp,
        )
        if self.shape.tie_embeddings:
            self.embedding.word_embeddings.weight = self.output_layer.weight
        else:
            self.embedding.requires_grad_(False)

    def freeze_mtp_layers_beyond(self, depth: int) -> None:
        """Freeze the MTP layers that no mtp term reaches (head k runs layer k - 1; none runs
        without the term): nothing would train them, the distributed optimizer would still
        decay them, and DDP's overlapped reduce expects a gradient from every trainable
        parameter."""
        for layer in self.mtp_layers[depth:]:
            layer.requires_grad_(False)

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight (last stage): this rank's vocab shard [V/tp, H]."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def stage_hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        shard: TokenShard | None = None,
    ) -> torch.Tensor:
        """This stage's decoder layers over packed inputs: [T, 1, H] pre-norm hidden states.
        The first stage starts from the embedding, the others from the tensor the pipeline
        schedule received (`set_input_tensor`). Under context parallelism the inputs are
        `shard`'s tokens of the row that `cu_seqlens` describes (None: all of them)."""
        hidden, _ = self._decoder(input_ids, position_ids, cu_seqlens, shard)
        return hidden

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        targets: torch.Tensor | None = None,
        shard: TokenShard | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Last stage: packed [T] inputs -> (final hidden [T, H], MTP hidden per head, each
        [T, H]).

        MTP head k (1-based) at row t reads the trunk's pre-norm hidden at t (head 1) or head
        k-1's output (final-normed both, for a family whose drafter reads those:
        `Family.mtp_normed_hidden`), and the embedding of token t+k = targets[t+k-1]; both are
        detached, so a draft loss never reaches the trunk. Rows whose t+k leaves the sequence
        hold garbage that the head loss masks out. The MTP heads run only when `targets` is given
        (never under context parallelism: row t+k may sit on another rank). `shard` as in
        `stage_hidden`.
        """
        hidden, rows = self._decoder(input_ids, position_ids, cu_seqlens, shard)
        final = self.decoder.final_layernorm(hidden)
        normed_input = bool(self.family and self.family.mtp_normed_hidden)
        mtp_input = final if normed_input else hidden
        return final[:, 0], self._mtp_hidden(mtp_input, targets, position_ids, rows)

    def _decoder(self, input_ids, position_ids, cu_seqlens, shard):
        shard = shard or TokenShard(0, 1, input_ids.numel())
        # The token mixers that run along each sequence (Gated DeltaNet) take the boundaries
        # on the host: a device copy is read back here once, not in every layer.
        host_cu_seqlens = cu_seqlens.cpu()
        lengths = (host_cu_seqlens[1:] - host_cu_seqlens[:-1]).tolist()
        _check_sequence_lengths(lengths, self.max_sequence_length)
        # The rotary table may sit on the CPU (Megatron keeps inv_freq off the module state).
        # packed_seq: rows are indexed by position id here, so Megatron must not cut the
        # table for a context-parallel rank itself.
        table = self.rotary_pos_emb(self.max_sequence_length, packed_seq=True)
        rows = PackedRows.of(
            packed_attention_mask(cu_seqlens, lengths, shard, input_ids.device),
            table.to(position_ids.device)[position_ids],
            host_cu_seqlens,
        )
        if self.pre_process:
            hidden = self.embedding(input_ids=input_ids[None], position_ids=position_ids[None])
        else:
            hidden = self.decoder.input_tensor
        return self._run_layers(hidden, rows), rows

    def _run_layers(self, hidden, rows: PackedRows) -> torch.Tensor:
        """The decoder layers; under `recompute: full` each keeps only its input for backward
        and runs again there. torch's non-reentrant checkpoint, not Megatron's: it carries
        the block mask (not a tensor) and the layers use no dropout, so no RNG to replay.
        The layers get no rotary table: the core attention rotates q and k (`PackedRows`)."""
        full = self.recompute == "full" and torch.is_grad_enabled()
        for layer in self.decoder.layers:
            kwargs = {"hidden_states": hidden, "attention_mask": rows}
            if full:
                hidden, _ = checkpoint(layer, use_reentrant=False, **kwargs)
            else:
                hidden, _ = layer(**kwargs)
        return hidden

    def _mtp_hidden(self, trunk_hidden, targets, position_ids, rows) -> list[torch.Tensor]:
        if targets is None:
            return []
        family = self.family
        zero_first = family is None or family.mtp_zero_first_embedding
        chain_normed = bool(family and family.mtp_normed_hidden)
        previous = trunk_hidden.detach()
        outputs = []
        for k, layer in enumerate(self.mtp_layers):
            next_tokens = torch.roll(targets, shifts=-k)
            with torch.no_grad():
                emb = self.embedding(input_ids=next_tokens[None], position_ids=position_ids[None])
                if zero_first:  # as the family's vLLM drafter does
                    emb = emb.masked_fill((position_ids == 0)[:, None, None], 0.0)
            out, normed = layer(previous, emb, rows)
            previous = normed if chain_normed else out
            outputs.append(normed[:, 0])
        return outputs


def check_native_mtp_loss_disabled(model: GPTModel) -> None:
    """Raise when Megatron's built-in MTP would run: its loss is attached to the trunk's
    hidden states (MTPLossAutoScaler) and so back-propagates into the policy, which the
    decoupled draft loss must never do. mtprun's MTP layers are `mtp_layers`, trained only
    by the fused head loss; Megatron's own must stay off even if a newer megatron-core
    turns them on by default or builds them from the config alone."""
    built = [n for n, m in model.named_modules() if isinstance(m, MultiTokenPredictionBlock)]
    reasons = []
    if model.config.mtp_num_layers:
        reasons.append(f"TransformerConfig.mtp_num_layers={model.config.mtp_num_layers}")
    if getattr(model, "mtp_process", False) or built:
        reasons.append(f"a MultiTokenPredictionBlock is built ({', '.join(built) or 'mtp'})")
    if reasons:
        raise RuntimeError(
            "Megatron-core's built-in MTP loss is enabled ("
            + "; ".join(reasons)
            + "): it would train the policy trunk through the MTP loss. mtprun trains its "
            "own MTP layers with the decoupled `mtp` loss term; leave mtp_num_layers unset "
            "and pass no mtp_block_spec to GPTModel (check a megatron-core upgrade's defaults)"
        )


# Per-head norms: one weight over each head, each tp rank normalising only its own heads.
_QK_NORMS = (
    "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight",
    "self_attention.out_norm.weight",  # a Gated DeltaNet's output norm, per value head
)


def sum_partial_grads(model: PolicyModel, tp_group: torch.distributed.ProcessGroup | None) -> None:
    """Sum over the tensor-parallel ranks the gradients of the weights that are replicated
    over them but of which each rank computes only a share (before the step).

    - the per-head q/k norms: one weight per head size, but each rank normalises only its own
      heads (megatron-core's finalize_model_grads sums them too, for `qk_layernorm`);
    - the MoE routers under tp: each rank routes only its share of the tokens
      (`TensorParallelMoELayer`); megatron-core marks such weights `sequence_parallel`.
    The sum is the whole layer's gradient and the replicas then take the same update. Reads
    the float32 `main_grad` where megatron's DDP keeps one. `tp_group` None: one
    tensor-parallel rank, nothing to sum."""
    if tp_group is None:
        return
    params = [
        p
        for n, p in model.named_parameters()
        if ((model.shape.qk_norm or model.shape.linear_attention) and n.endswith(_QK_NORMS))
        or getattr(p, "sequence_parallel", False)
    ]
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad for p in params]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=tp_group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(summed.view_as(grad))


def load_megatron_weights(model: PolicyModel, tensors: dict[str, torch.Tensor]) -> None:
    """Load converted tensors; every parameter must be covered (Megatron's `_extra_state`
    entries carry no weights and are skipped)."""
    result = model.load_state_dict(tensors, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"converted weights do not match the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def load_policy_model(
    model_dir: Path,
    shape: ModelShape,
    device: torch.device,
    tp_rank: int,
    tp_size: int,
    stage: PipelineStage | None = None,
    recompute: Recompute = "none",
    dtype: torch.dtype = torch.float32,
    ep: tuple[int, int] = (0, 1),
    moe: MoEOptions | None = None,
) -> PolicyModel:
    """The HF folder's model as a PolicyModel on `device` with `dtype` weights, holding this
    TP rank's shards of pipeline `stage` (None: the whole model) and expert-parallel rank
    `ep` = (rank, size)'s experts, with `recompute` (see transformer_config), `moe`'s router
    losses and the fusions of a CUDA device."""
    fused = torch.device(device).type == "cuda"
    if fused and shape.linear_attention is not None:
        require_gdn_kernels()  # fla's kernels, named in the error, before any weight loads
    model = PolicyModel(shape, stage, recompute, dtype, fused, moe).to(device=device, dtype=dtype)
    _keep_router_biases_float32(model)
    weights = hf_to_megatron(
        read_hf_weights(model_dir), shape, tp_rank, tp_size, str(model_dir), *ep, model.stage
    )
    load_megatron_weights(model, weights)
    return model


def _keep_router_biases_float32(model: torch.nn.Module) -> None:
    """A router's score-correction bias only ranks experts, by differences far below bf16's
    resolution: keep it float32 under bf16 weights (megatron-core's router does so too, but
    only from its first forward, after the checkpoint would have been rounded)."""
    for module in model.modules():
        bias = getattr(module, "expert_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.data = bias.data.float()


def read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors


def _check_sequence_lengths(lengths: list[int], positions: int) -> None:
    """ValueError for a sequence longer than the rotary table: its position ids would index
    past it, which on a GPU is a device-side assert that kills the process."""
    longest = max(lengths)
    if longest > positions:
        raise ValueError(
            f"a packed sequence of {longest} tokens is longer than the model's "
            f"{positions} positions (max_position_embeddings): shorten it (data.packing_length, "
            "rollout.max_tokens) or train a model with more positions"
        )
