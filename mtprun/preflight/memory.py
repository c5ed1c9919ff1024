"""The trainer's memory per rank: weights, gradients, optimizer state, activations, head loss.

An estimate of what one trainer rank holds at its peak, in bytes, for the most loaded pipeline
stage. It counts the tensors that scale with the model and the micro batch; it leaves out the
CUDA context, allocator fragmentation, kernel workspaces, communication buffers and the
pipeline's hidden-state messages (together typically a few GiB), so read it as a floor.

Notation: h hidden, L decoder layers, L_s = L / pp of them per stage, q = heads/tp x head_dim,
kv = kv_heads/tp x head_dim, f = intermediate/tp, V' = vocab padded to a multiple of tp,
b = bytes of the compute dtype (2 for bfloat16, 4 for float32), T = the micro batch's tokens on
this rank (`local_tokens`: trainer.micro_batch_tokens / cp). A mixture-of-experts model
(`ModelShape.experts`): E routed experts of width F a sparse layer (whole on every
tensor-parallel rank, which routes 1/tp of the tokens), k = top_k of them per token, F_s/tp a
shared expert's width (0 without; split over tp like a dense MLP), ep = parallel.ep.

Parameters of stage s on one tensor-parallel rank:

    attn   = h (q + 2 kv) + [qkv bias] (q + 2 kv) + q h + 2 h     (+ the q/k norms)
    layer  = attn + 2 f h + f h                   (a dense layer: SwiGLU MLP)
    moe    = attn + E h + 3 h F_s                 (a sparse layer, replicated part: router,
                                                   shared expert of width F_s if any)
           + E/ep 3 h F                           (its expert part: this rank's E/ep routed
                                                   experts of width F, gate/up and down)
    P(s)   = sum over the stage's layers of layer or moe (a mixture-of-experts model's dense
             layers, `ExpertShape.dense_layers`, keep the dense MLP)
           + V'/tp h                              (first stage: the input embedding)
           + h + V'/tp h                          (last stage: final norm, output layer; a tied
                                                   model's output layer is the embedding itself
                                                   unless pp > 1, where the last stage keeps a
                                                   trained copy)
           + mtp (layer + 2 h^2 + 3 h)            (last stage: MTP layers, sparse (moe in
                                                   place of layer) in a model with experts; their
                                                   input_proj is replicated over tp)

Precision follows the trainer (`mtprun.runner.trainer.mixed_precision`): `model.dtype: bfloat16` on
GPUs trains bf16 weights with float32 main gradients and megatron-core's distributed optimizer,
whose float32 master weights and Adam state are sharded over the dp x cp ranks; float32 recipes
(and `mtp.separate_optimizer: true`, which takes the same path) train float32 weights with
torch.optim, whose state is not sharded:

    weights    = P(s) x (2 if bf16 weights else 4)
    gradients  = P(s) x 4
    optimizer  = P(s) x (4 + m for adamw, 4 for sgd) / (dp cp)    bf16 weights
               = P(s) x (8 for adamw, 0 for sgd)                  float32 weights (sgd has
                                                                  no momentum)

with m the bytes of AdamW's two moments per parameter: 8 (`trainer.optimizer_state: float32`)
or 4 (`bfloat16`; the float32 master weights stay). float32 weights keep float32 moments. The
distributed optimizer shards the expert part of P(s) over the expert-data-parallel group
instead, the dp cp / ep ranks that hold the same experts.

Activations that backward keeps, per token and per decoder layer (pre-norm Qwen2/Llama layer,
GQA, SwiGLU, flash-class attention: no [T, T] scores; sequence parallelism is off, so the
hidden-sized ones are whole on every tensor-parallel rank):

    none       A = b (4 h                    two RMSNorm inputs and outputs
                      + q + 2 kv cp          q, k, v (under cp > 1 the all-gathered keys
                                             and values of the whole micro batch)
                      + q + q                attention output, attention-projection input
                      + 2 f + f)             fc1 output, SwiGLU product
                   + 4 heads/tp              the attention's float32 log-sum-exp
    selective  A - 3 f b                     the trainer's selective recomputation is
                                             megatron-core's MLP recomputation: fc1 output and
                                             SwiGLU product are rebuilt in backward
    full       h b                           each layer's input; the layer runs again in
                                             backward, and one layer's `none` activations of
                                             one micro batch exist while it does

A sparse layer keeps A_attn = A_none - 3 f b and, in place of the dense MLP, what
megatron-core's MoE layer (all-to-all dispatcher, `GroupedExperts`) saves for the k copies of
each token that it dispatches (on average k T rows reach this rank's experts whatever ep is):

    A_moe = A_attn + [k b (h + 2 F + F + F + 1)  expert input, fc1 output, SwiGLU output and
                                                 its probability-weighted copy, the probability
                   + 2 E + 20 k] / tp            routing: two [T, E] bool maps, float32 top-k
                                                 scores, int64 top-k and permutation indices
                                                 (each tensor-parallel rank routes T / tp)
                   + 3 F_s b                     a shared expert's fc1 output and product

under `none` and `selective` alike (megatron-core's MLP recomputation skips MoE layers). The
permuted copies the dispatcher makes on the way in and out, and the gradients of backward,
are transient (one layer at a time) and not counted. Against bench/RESULTS.md (issue 24,
Qwen3-30B-A3B's shape cut to 4 layers, one 16384-token micro batch, bf16, float32 moments,
recompute none): 60.5 GiB estimated, 62.1 GiB measured on one H100; 8 layers, dp 2, ep 2:
65.1 GiB estimated, 69.1 GiB measured a rank (`tests/spec/test_memory_moe.py`).

    activations(s) = T (pp - s) [sum over the stage's layers of A_mode
                                 + last stage: 2 h b + mtp (8 h b + A_mode')]
                   + [full] T max over the stage's layers of A_none

1F1B keeps up to pp - s micro batches in flight on stage s (s from 0). The last stage adds the
final norm's input and output and, per MTP layer, its norms, the [2h] input-projection input
and one decoder layer (never under full recomputation: the trainer checkpoints only the
trunk's layers, so A_mode' is A_none there). Head-loss buffers (last stage) are the fused
plan's buffers from `mtprun.compiler.estimate.estimate_head_cost` for T rows.

The reported rank is the stage with the largest total.

LoRA (`model.lora`, rank r): every base parameter is frozen (weights only: no gradients, no
optimizer state) and the adapters of the stage's decoder layers train, per layer and rank

    lora   = qkv: 3 r h + r (q + 2 kv)     (A of q/k/v replicated, B split like the base)
           + proj: r q + h r               (A split along the input, B replicated)
           + fc1: 2 r h + 2 f r
           + fc2: r f + h r

(the targeted ones only), which take gradients and optimizer state as trained parameters do.
Their activations add, per token, layer and adapter, b r (the low-rank product) and with
dropout the dropped input and its mask, (b + 1) x the adapter's input width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mtprun.compiler import HeadPlan, compile_recipe
from mtprun.compiler.estimate import FLOAT32, estimate_head_cost, padded_vocab
from mtprun.models.shape import ModelShape
from mtprun.preflight.model_shape import recipe_shape
from mtprun.spec.model import LORA_TARGETS, LoRASection
from mtprun.spec.parallel import ParallelSection
from mtprun.spec.recipe import Recipe

GIB = 2**30
Recompute = Literal["none", "selective", "full"]
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_ADAM_MOMENTS = 2 * FLOAT32  # exp_avg and exp_avg_sq
_MOMENT_BYTES = {"float32": 2 * FLOAT32, "bfloat16": 2 * 2}  # trainer.optimizer_state
_MASTER = FLOAT32  # the distributed optimizer's float32 copy of bf16 weights

# Parts of the estimate, in the order tables and messages list them.
PARTS = ("weights", "gradients", "optimizer", "activations", "head_loss")
PART_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "head_loss": "head loss",
}


def layer_params(shape: ModelShape, tp: int) -> int:
    """Parameters of one dense decoder layer on one tensor-parallel rank."""
    h, f = shape.hidden, _split(shape.intermediate, tp)
    # linear_fc1 (gate and up), linear_fc2.
    return _attention_params(shape, tp) + 2 * f * h + f * h


def moe_layer_params(shape: ModelShape, tp: int, ep: int) -> tuple[int, int]:
    """(replicated, expert) parameters of one sparse decoder layer on one rank of `ep`
    expert-parallel ranks: attention, norms, the router and a shared expert; this rank's
    count/ep routed experts (gate, up and down projections each)."""
    experts = shape.experts
    if experts is None:
        raise ValueError("moe_layer_params needs a shape with experts")
    h = shape.hidden
    shared = 3 * h * _split(experts.shared_intermediate, tp)
    # Whole experts on every tensor-parallel rank (`TensorParallelMoELayer`).
    routed = _split(experts.count, ep) * 3 * h * experts.intermediate
    return _attention_params(shape, tp) + experts.count * h + shared, routed


def _attention_params(shape: ModelShape, tp: int) -> int:
    """A decoder layer's attention and its two norms on one tensor-parallel rank."""
    h = shape.hidden
    qkv = _q_width(shape, tp) + 2 * _kv_width(shape, tp)
    bias = qkv if shape.qkv_bias else 0
    qk_norms = 2 * shape.head_dim if shape.qk_norm else 0  # per head, replicated
    # linear_qkv (+ bias), linear_proj, input_layernorm and pre_mlp_layernorm.
    return h * qkv + bias + _q_width(shape, tp) * h + 2 * h + qk_norms


def lora_layer_params(shape: ModelShape, tp: int, lora: LoRASection) -> int:
    """Adapter parameters of one decoder layer on one tensor-parallel rank (module
    docstring: lora)."""
    h, r, f = shape.hidden, lora.rank, _split(shape.intermediate, tp)
    q, kv = _q_width(shape, tp), _kv_width(shape, tp)
    per_target = {
        "qkv": 3 * r * h + r * (q + 2 * kv),
        "proj": r * q + h * r,
        "fc1": 2 * r * h + 2 * f * r,
        "fc2": r * f + h * r,
    }
    return sum(per_target[t] for t in lora.layers)


def _lora_per_token(shape: ModelShape, tp: int, b: int, lora: LoRASection) -> int:
    """Bytes the adapters of one decoder layer keep for backward per token."""
    adapters = len(lora.modules)
    kept = adapters * lora.rank * b
    if lora.dropout > 0:
        h, q, f = shape.hidden, _q_width(shape, tp), _split(shape.intermediate, tp)
        width = {"qkv": h, "proj": q, "fc1": h, "fc2": f}
        kept += sum(len(LORA_TARGETS[t]) * width[t] * (b + 1) for t in lora.layers)
    return kept


def parameters(shape: ModelShape) -> int:
    """Parameters of the whole model, as its HF folder holds them (a tied output layer once,
    MTP layers included, every expert)."""
    return _stage_params(shape, 1, 1, 0).total


def stage_layers(shape: ModelShape, pp: int, stage: int) -> range:
    """The decoder layers (0-based indices) of pipeline stage `stage`."""
    per_stage = _split(shape.layers, pp)
    return range(stage * per_stage, min((stage + 1) * per_stage, shape.layers))


def _vocab_rows(shape: ModelShape, tp: int) -> int:
    """Rows of the embedding / output layer on one tensor-parallel rank."""
    return padded_vocab(shape.vocab, tp) // tp


def _q_width(shape: ModelShape, tp: int) -> int:
    """Query channels on one tensor-parallel rank (whole heads)."""
    return _split(shape.heads, tp) * shape.head_dim


def _kv_width(shape: ModelShape, tp: int) -> int:
    """Key (or value) channels on one tensor-parallel rank."""
    return _split(shape.kv_heads, tp) * shape.head_dim


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes one trainer rank holds on pipeline stage `stage` (0-based), its most loaded."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    head_loss: int
    recompute: Recompute
    stage: int
    stages: int  # parallel.pp
    layers: int  # decoder layers on the stage
    in_flight: int  # micro batches whose activations the stage keeps at once (1F1B)
    tokens: int  # tokens of one micro batch on this rank (micro_batch_tokens / cp)
    bf16_weights: bool
    optimizer_shards: int  # ranks the optimizer state is split over (dp x cp, or 1)
    # AdamW's moments: float32 or bfloat16 (trainer.optimizer_state; float32 weights keep
    # float32 ones); "none" for SGD, which keeps no moments.
    optimizer_state: str = "float32"
    # Mixture of experts (all 0 for a dense model): the sparse layers on the stage, the routed
    # experts of each on this rank (count / ep), the parameters of those experts on this rank
    # (part of the weights, gradients and optimizer state above) and the ranks their optimizer
    # state is split over (the expert-data-parallel group: dp x cp / ep, or 1).
    sparse_layers: int = 0
    experts_per_rank: int = 0
    expert_params: int = 0
    expert_optimizer_shards: int = 0
    # LoRA (model.lora): the adapters' parameters on this rank, the only ones that train
    # (0: full fine-tuning, every parameter trains).
    lora_params: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts().values())

    def parts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in PARTS}

    def largest(self) -> str:
        """The name of the largest part (one of PARTS)."""
        parts = self.parts()
        return max(parts, key=parts.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every part and the total in bytes, and how they were counted."""
        return {
            **self.parts(),
            "total": self.total,
            "recompute": self.recompute,
            "pipeline_stage": self.stage,
            "pipeline_stages": self.stages,
            "layers": self.layers,
            "micro_batches_in_flight": self.in_flight,
            "tokens_per_micro_batch": self.tokens,
            "bf16_weights": self.bf16_weights,
            "optimizer_shards": self.optimizer_shards,
            "optimizer_state": self.optimizer_state,
            "sparse_layers": self.sparse_layers,
            "experts_per_rank": self.experts_per_rank,
            "expert_params": self.expert_params,
            "expert_optimizer_shards": self.expert_optimizer_shards,
            "lora_params": self.lora_params,
        }


def local_tokens(micro_batch_tokens: int, cp: int) -> int:
    """Tokens of one micro batch on a context-parallel rank: it holds two of 2*cp chunks."""
    return 2 * -(-micro_batch_tokens // (2 * cp))


def estimate_trainer_memory(
    shape: ModelShape,
    parallel: ParallelSection,
    *,
    dtype: str,
    micro_batch_tokens: int,
    recompute: Recompute = "none",
    optimizer: Literal["adamw", "sgd"] = "adamw",
    optimizer_state: Literal["float32", "bfloat16"] = "float32",
    separate_mtp_optimizer: bool = False,
    plan: HeadPlan | None = None,
    lora: LoRASection | None = None,
) -> TrainerMemory:
    """Memory of one trainer rank on its most loaded pipeline stage (module docstring).

    `optimizer_state` is the dtype of AdamW's moments under bf16 weights (float32 weights keep
    float32 ones). `plan` is the compiled head loss (its buffers on the last stage, the MTP
    layers beyond its mtp term frozen); None: no head loss, every MTP layer trained. `lora`:
    the base is frozen and only its adapters train.
    """
    tp, pp, cp, dp, ep = parallel.tp, parallel.pp, parallel.cp, parallel.dp, parallel.ep
    act_bytes = _DTYPE_BYTES[dtype]
    # The trainer's mixed-precision path: bf16 weights, the distributed optimizer. Anything else
    # trains float32 weights with torch.optim (mtprun.runner.trainer.trainer: `mixed`).
    bf16_weights = act_bytes == 2 and not separate_mtp_optimizer
    shards = dp * cp if bf16_weights else 1
    # Expert weights are reduced and sharded over the ranks that hold the same experts.
    expert_shards = max(shards // ep, 1) if bf16_weights else 1
    optimizer_state, state_bytes = _optimizer_state(optimizer, optimizer_state, bf16_weights)
    tokens = local_tokens(micro_batch_tokens, cp)
    # Without a plan every MTP layer counts as trained (PolicyModel.freeze_mtp_layers_beyond).
    mtp_trained = shape.mtp_layers if plan is None else min(plan.mtp_depth, shape.mtp_layers)
    head = 0
    if plan is not None:
        head = estimate_head_cost(
            plan, rows=tokens, hidden=shape.hidden, vocab=shape.vocab, param_bytes=act_bytes
        ).fused_bytes

    candidates = []
    for stage in range(pp):
        params = _stage_params(shape, tp, pp, stage, ep, mtp_trained)
        adapters, held_experts = 0, params.expert
        if lora is not None:  # the base is frozen; the adapters train (dense replicated)
            adapters = len(stage_layers(shape, pp, stage)) * lora_layer_params(shape, tp, lora)
            params = _StageParams(adapters, 0, params.total)
        trained = params.replicated + params.expert
        in_flight = pp - stage
        last = stage == pp - 1
        sparse = sum(map(shape.is_moe_layer, stage_layers(shape, pp, stage)))
        optimizer_bytes = -(-params.replicated * state_bytes // shards)
        optimizer_bytes += -(-params.expert * state_bytes // expert_shards)
        candidates.append(
            TrainerMemory(
                weights=(trained + params.frozen) * (2 if bf16_weights else 4),
                gradients=trained * FLOAT32,
                optimizer=optimizer_bytes,
                activations=_activations(
                    shape, parallel, act_bytes, recompute, tokens, stage, mtp_trained
                )
                + _lora_activations(shape, parallel, act_bytes, recompute, tokens, stage, lora),
                head_loss=head if last else 0,
                recompute=recompute,
                stage=stage,
                stages=pp,
                layers=_split(shape.layers, pp),
                in_flight=in_flight,
                tokens=tokens,
                bf16_weights=bf16_weights,
                optimizer_shards=shards,
                optimizer_state=optimizer_state,
                sparse_layers=sparse,
                experts_per_rank=_split(shape.experts.count, ep) if shape.experts else 0,
                expert_params=held_experts,
                expert_optimizer_shards=expert_shards if shape.experts else 0,
                lora_params=adapters,
            )
        )
    return max(candidates, key=lambda m: m.total)  # the first of equals: stage 0


def _optimizer_state(optimizer: str, moments: str, bf16_weights: bool) -> tuple[str, int]:
    """The optimizer state's dtype as reported, and its bytes per trained parameter."""
    if optimizer != "adamw":  # SGD without momentum: the bf16 path's master weights alone
        return "none", _MASTER if bf16_weights else 0
    if not bf16_weights:
        return "float32", _ADAM_MOMENTS  # torch.optim on float32 weights
    return moments, _MASTER + _MOMENT_BYTES[moments]


@dataclass(frozen=True)
class _StageParams:
    replicated: int  # trained, not experts (the optimizer shards them over dp x cp)
    expert: int  # trained routed experts of this rank (sharded over dp x cp / ep)
    frozen: int

    @property
    def total(self) -> int:
        return self.replicated + self.expert + self.frozen


def _stage_params(
    shape: ModelShape, tp: int, pp: int, stage: int, ep: int = 1, mtp_trained: int | None = None
) -> _StageParams:
    """Parameters of pipeline stage `stage` on one tensor-parallel and expert-parallel rank;
    `mtp_trained` of the MTP layers train and run (None: all of them)."""
    h = shape.hidden
    # pp divides the layers (a rule checks); the last stage holds fewer otherwise.
    layers = stage_layers(shape, pp, stage)
    sparse = sum(map(shape.is_moe_layer, layers))
    trained = (len(layers) - sparse) * layer_params(shape, tp)
    expert = 0
    if sparse:
        replicated, routed = moe_layer_params(shape, tp, ep)
        trained += sparse * replicated
        expert = sparse * routed
    frozen = 0
    embedding = _vocab_rows(shape, tp) * h
    first, last = stage == 0, stage == pp - 1
    if first:
        trained += embedding
    if last:
        trained += h  # final norm
        # Tied and one stage: the output layer is the embedding. Tied over stages: the last
        # stage keeps a trained copy (gradients summed with the first's, see pp_layout).
        if not shape.tie_embeddings or pp > 1:
            trained += embedding
        # MTP layer (MiMo, GLM-4.5): token/hidden/final norms, input_proj [h, 2h] (replicated
        # over tp), one decoder layer (sparse in a model with experts, as the trainer builds it).
        # Those beyond the mtp term's depth are frozen (PolicyModel.freeze_mtp_layers_beyond).
        dense, routed = 2 * h * h + 3 * h, 0
        if shape.experts is None:
            dense += layer_params(shape, tp)
        else:  # a mixture-of-experts model's MTP layers are sparse (GLM-4.5)
            replicated, routed = moe_layer_params(shape, tp, ep)
            dense += replicated
        mtp_trained = shape.mtp_layers if mtp_trained is None else mtp_trained
        trained += mtp_trained * dense
        expert += mtp_trained * routed
        frozen += (shape.mtp_layers - mtp_trained) * (dense + routed)
        if shape.mtp_layers and pp > 1 and not shape.tie_embeddings:
            frozen += embedding  # a frozen embedding copy for the MTP layers' lookups
    return _StageParams(trained, expert, frozen)


def _per_token_layer(
    shape: ModelShape, parallel: ParallelSection, b: int, mode: Recompute, sparse: bool = False
) -> int:
    """Bytes one decoder layer (a sparse one: with experts) keeps for backward per token under
    recomputation `mode`."""
    h, tp, cp = shape.hidden, parallel.tp, parallel.cp
    if mode == "full":
        return h * b  # the layer's input (the residual stream is in the compute dtype)
    q, kv, f = _q_width(shape, tp), _kv_width(shape, tp), _split(shape.intermediate, tp)
    kept = (
        4 * h  # input_layernorm and pre_mlp_layernorm: input and output each
        + q
        + 2 * kv * cp  # q, k, v after RoPE; under cp the attention keeps the gathered k, v
        + 2 * q  # the attention's output and the attention projection's input (a copy)
    ) * b + FLOAT32 * _split(shape.heads, tp)  # log-sum-exp per head and token
    if sparse:
        # megatron-core's MLP recomputation leaves MoE layers alone: kept under selective too.
        return kept + _per_token_experts(shape, tp, b)
    if mode == "none":
        kept += 3 * f * b  # fc1 output (gate and up, 2 f) and the SwiGLU product (f)
    return kept


def _per_token_experts(shape: ModelShape, tp: int, b: int) -> int:
    """Bytes a sparse layer's MLP keeps for backward per token (module docstring: A_moe);
    under tp each rank routes 1/tp of the tokens to whole experts."""
    experts = shape.experts
    assert experts is not None
    h, k, width = shape.hidden, experts.top_k, experts.intermediate
    # Each of the k dispatched copies of the token: the first grouped GEMM's input (h), the
    # SwiGLU kernel's input (its fc1 output, 2 F), the SwiGLU output and its copy weighted by
    # the routing probability (the second GEMM's input), and that probability.
    dispatched = k * (h + 2 * width + width + width + 1) * b
    # Routing: the [T, E] bool routing map and its transposed copy, the float32 top-k scores
    # (softmax output), the int64 top-k indices and the dispatcher's permutation indices.
    routing = 2 * experts.count + k * (FLOAT32 + 8 + 8)
    shared = 3 * _split(experts.shared_intermediate, tp) * b  # its fc1 output and product
    return _split(dispatched + routing, tp) + shared


def _activations(
    shape: ModelShape,
    parallel: ParallelSection,
    b: int,
    recompute: Recompute,
    tokens: int,
    stage: int,
    mtp_trained: int,
) -> int:
    pp = parallel.pp
    sparse = [shape.is_moe_layer(i) for i in stage_layers(shape, pp, stage)]
    per_micro_batch = sum(_per_token_layer(shape, parallel, b, recompute, m) for m in sparse)
    if stage == pp - 1:
        h = shape.hidden
        mtp_mode = "none" if recompute == "full" else recompute
        per_micro_batch += 2 * h * b  # the final norm's input and output (the head's input)
        per_micro_batch += mtp_trained * (
            8 * h * b + _per_token_layer(shape, parallel, b, mtp_mode, shape.experts is not None)
        )
    total = tokens * (pp - stage) * per_micro_batch
    if recompute == "full":  # the layer being rerun (a sparse one, where there are any)
        total += tokens * _per_token_layer(shape, parallel, b, "none", any(sparse))
    return total


def _lora_activations(
    shape: ModelShape,
    parallel: ParallelSection,
    b: int,
    recompute: Recompute,
    tokens: int,
    stage: int,
    lora: LoRASection | None,
) -> int:
    """The adapters' share of the stage's activations (under full recomputation they are
    rebuilt with their layer: one layer's worth)."""
    if lora is None:
        return 0
    per_layer = tokens * _lora_per_token(shape, parallel.tp, b, lora)
    if recompute == "full":
        return per_layer
    layers = len(stage_layers(shape, parallel.pp, stage))
    return per_layer * layers * (parallel.pp - stage)


def _split(n: int, parts: int) -> int:
    return -(-n // parts)


def recipe_trainer_memory(
    recipe: Recipe, plan: HeadPlan | None = None, full_finetune: bool = False
) -> TrainerMemory | str:
    """The estimate for `recipe` (its head loss from `plan`, compiled when not given), or why
    it cannot be made here; `full_finetune`: as if every parameter trained (model.lora
    ignored), what LoRA is measured against."""
    shape = recipe_shape(recipe)
    if isinstance(shape, str):
        return shape
    if plan is None:
        plan = compile_recipe(recipe)
    mtp = next((t for t in recipe.losses if t.kind == "mtp"), None)
    return estimate_trainer_memory(
        shape,
        recipe.parallel,
        dtype=recipe.model.dtype,
        micro_batch_tokens=recipe.trainer.micro_batch_tokens,
        recompute=recipe.trainer.recompute,
        optimizer=recipe.trainer.optimizer,
        optimizer_state=recipe.trainer.optimizer_state,
        separate_mtp_optimizer=bool(getattr(mtp, "separate_optimizer", False)),
        plan=plan,
        lora=None if full_finetune else recipe.model.lora,
    )
