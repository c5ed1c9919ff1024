"""The trainer's memory per rank (mtprun.preflight.memory) and validate's warning when it does
not fit `resources.gpu_memory_gib`."""

from __future__ import annotations

import pytest

from mtprun.compiler import HeadPlan
from mtprun.compiler.estimate import estimate_head_cost
from mtprun.models.shape import ModelShape
from mtprun.preflight import load_recipe
from mtprun.preflight.memory import (
    TrainerMemory,
    estimate_trainer_memory,
    local_tokens,
    recipe_trainer_memory,
)
from mtprun.spec.errors import RecipeWarning
from mtprun.spec.parallel import ParallelSection

# hidden 64, 4 layers, 4 query / 2 KV heads of 16, FFN 128, vocab 1000, untied, q/k/v biases.
SMALL = ModelShape(
    hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1000
)
TOKENS = 1024

# Parameters by hand, tp = 1: q = 4*16 = 64, kv = 2*16 = 32, f = 128.
# One layer: qkv 64*(64+2*32) + bias 128 + proj 64*64 + fc1 64*2*128 + fc2 128*64 + norms 2*64
LAYER = 8192 + 128 + 4096 + 16384 + 8192 + 128  # 37120
EMBEDDING = 1000 * 64
PARAMS = 4 * LAYER + EMBEDDING + 64 + EMBEDDING  # layers, embedding, final norm, output layer
# tp = 2: q = 32, kv = 16, f = 64, vocab rows 500.
LAYER_TP2 = 64 * 64 + 64 + 32 * 64 + 64 * 128 + 64 * 64 + 128  # 18624
PARAMS_TP2 = 4 * LAYER_TP2 + 500 * 64 + 64 + 500 * 64
REPLICATED = 4 * 2 * 64 + 64  # RMSNorm weights: whole on every tensor-parallel rank

# Activations per token and layer, bf16 (2 bytes), tp = 1:
# norms 4*64 + q 64 + k, v 2*32 + attention output and projection input 2*64 + fc1 2*128
# + SwiGLU 128, times 2 bytes, + the float32 log-sum-exp of 4 heads.
PER_LAYER_NONE = (256 + 64 + 64 + 128 + 256 + 128) * 2 + 4 * 4  # 1808
PER_LAYER_SELECTIVE = PER_LAYER_NONE - 3 * 128 * 2  # the MLP's fc1 output and SwiGLU: 1040
PER_LAYER_FULL = 64 * 2  # each layer's input
FINAL_NORM = 2 * 64 * 2  # the final norm's input and output


def _estimate(
    size: ModelShape = SMALL,
    dtype: str = "bfloat16",
    recompute: str = "none",
    optimizer: str = "adamw",
    plan: HeadPlan | None = None,
    **layout: int,
) -> TrainerMemory:
    return estimate_trainer_memory(
        size,
        ParallelSection(**layout),
        dtype=dtype,
        micro_batch_tokens=TOKENS,
        recompute=recompute,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        plan=plan,
    )


def test_weights_gradients_and_optimizer_state_by_hand() -> None:
    assert PARAMS == 276544
    memory = _estimate()
    assert memory.weights == 2 * PARAMS  # bf16 compute weights
    assert memory.gradients == 4 * PARAMS  # float32 main gradients
    # AdamW: float32 master copy + exp_avg + exp_avg_sq, one data-parallel rank holds them all.
    assert memory.optimizer == 12 * PARAMS
    assert memory.head_loss == 0  # no plan given
    assert memory.total == memory.weights + memory.gradients + 12 * PARAMS + memory.activations


def test_the_distributed_optimizer_shards_its_state_over_dp_and_cp() -> None:
    assert _estimate(dp=2).optimizer == 12 * PARAMS // 2
    assert _estimate(dp=2, cp=2).optimizer == 12 * PARAMS // 4
    assert _estimate(dp=2).gradients == 4 * PARAMS  # the main-gradient buffer stays whole
    assert _estimate(dp=2).weights == 2 * PARAMS
    assert _estimate(optimizer="sgd").optimizer == 4 * PARAMS  # master copy only
    assert _estimate(optimizer="sgd", dp=2).optimizer == 2 * PARAMS


def test_float32_weights_train_with_an_unsharded_torch_optimizer() -> None:
    memory = _estimate(dtype="float32", dp=2)
    assert memory.weights == 4 * PARAMS
    assert memory.gradients == 4 * PARAMS
    assert memory.optimizer == 8 * PARAMS  # exp_avg + exp_avg_sq; no master copy, no sharding
    assert not memory.bf16_weights and memory.optimizer_shards == 1
    assert _estimate(dtype="float32", optimizer="sgd").optimizer == 0  # SGD without momentum
    # float32 activations: every byte count doubles, the float32 log-sum-exp does not.
    assert memory.activations == TOKENS * (4 * (2 * PER_LAYER_NONE - 16) + 2 * FINAL_NORM)


def test_activations_by_hand_and_recompute_modes_in_order() -> None:
    none, selective, full = (_estimate(recompute=m) for m in ("none", "selective", "full"))
    assert none.activations == TOKENS * (4 * PER_LAYER_NONE + FINAL_NORM)
    assert selective.activations == TOKENS * (4 * PER_LAYER_SELECTIVE + FINAL_NORM)
    # full: each layer's input, plus one layer's activations while it is recomputed.
    assert full.activations == TOKENS * (4 * PER_LAYER_FULL + FINAL_NORM + PER_LAYER_NONE)
    assert none.activations > selective.activations > full.activations
    assert none.total > selective.total > full.total
    assert none.weights == selective.weights == full.weights
    assert (none.recompute, selective.recompute, full.recompute) == ("none", "selective", "full")


def test_tensor_parallelism_halves_the_sharded_parts() -> None:
    one, two = _estimate(), _estimate(tp=2)
    assert PARAMS_TP2 == 138560
    assert two.weights == 2 * PARAMS_TP2 and two.gradients == 4 * PARAMS_TP2
    # Matrices, biases and vocab rows halve; the RMSNorm weights are whole on both ranks.
    assert PARAMS_TP2 - REPLICATED == (PARAMS - REPLICATED) // 2
    # Head- and FFN-sized activations halve; hidden-sized ones (the norms) do not.
    per_layer_tp2 = (256 + 32 + 32 + 64 + 128 + 64) * 2 + 2 * 4
    assert two.activations == TOKENS * (4 * per_layer_tp2 + FINAL_NORM)
    assert two.activations < one.activations


def test_context_parallelism_splits_tokens_and_keeps_the_gathered_keys() -> None:
    memory = _estimate(cp=2)
    assert memory.tokens == local_tokens(TOKENS, 2) == 512
    # k and v of the whole micro batch (2x the local tokens) stay for the attention's backward.
    per_layer = PER_LAYER_NONE + 2 * 32 * 2
    assert memory.activations == 512 * (4 * per_layer + FINAL_NORM)
    assert local_tokens(1001, 2) == 502  # two of 4 chunks of ceil(1001 / 4) tokens


def test_pipeline_parallelism_reports_the_most_loaded_stage() -> None:
    # Stage 0: embedding + 2 layers, 2 micro batches in flight under 1F1B.
    # Stage 1: 2 layers + final norm + output layer, 1 micro batch, the head-loss buffers.
    stage0_params = 2 * LAYER + EMBEDDING
    stage0 = 18 * stage0_params + TOKENS * 2 * (2 * PER_LAYER_NONE)
    stage1_params = 2 * LAYER + 64 + EMBEDDING
    stage1 = 18 * stage1_params + TOKENS * (2 * PER_LAYER_NONE + FINAL_NORM)

    memory = _estimate(pp=2)  # no head loss: stage 0 holds the most
    assert (memory.stage, memory.stages, memory.in_flight, memory.layers) == (0, 2, 2, 2)
    assert memory.weights == 2 * stage0_params
    assert memory.total == stage0 > stage1

    plan = HeadPlan.from_losses([{"kind": "ce"}])
    head = estimate_head_cost(plan, rows=TOKENS, hidden=64, vocab=1000, param_bytes=2)
    assert head.fused_bytes == TOKENS * 1000 * 4 * 2 + TOKENS * 3 * 4  # a tile pair + 3 stats
    memory = _estimate(pp=2, plan=plan)  # the head's buffers make the last stage the largest
    assert stage1 + head.fused_bytes > stage0
    assert (memory.stage, memory.in_flight, memory.head_loss) == (1, 1, head.fused_bytes)
    assert memory.total == stage1 + head.fused_bytes


def test_a_tied_output_layer_is_one_copy_unless_split_over_stages() -> None:
    tied = ModelShape(**{**SMALL.__dict__, "tie_embeddings": True})
    assert _estimate(tied).weights == 2 * (PARAMS - EMBEDDING)
    # pp = 2: the last stage keeps a trained copy of the embedding as its output layer.
    assert _estimate(tied, pp=2, plan=HeadPlan.from_losses([{"kind": "ce"}])).weights == 2 * (
        2 * LAYER + 64 + EMBEDDING
    )


def test_mtp_layers_count_on_the_last_stage() -> None:
    mimo = ModelShape(**{**SMALL.__dict__, "mtp_layers": 1})
    # A decoder layer, input_proj [64, 128] (replicated over tp) and three norms.
    assert _estimate(mimo).gradients == 4 * (PARAMS + LAYER + 2 * 64 * 64 + 3 * 64)
    # Its activations: two input norms, the [2h] projection input, the final norm, one layer.
    extra = 8 * 64 * 2 + PER_LAYER_NONE
    assert _estimate(mimo).activations == _estimate().activations + TOKENS * extra


def test_mtp_layers_without_an_mtp_term_are_frozen_and_do_not_run() -> None:
    mimo = ModelShape(**{**SMALL.__dict__, "mtp_layers": 1})
    mtp_layer = LAYER + 2 * 64 * 64 + 3 * 64
    ce = HeadPlan.from_losses([{"kind": "ce"}])
    ce_mtp = HeadPlan.from_losses([{"kind": "ce"}, {"kind": "mtp"}])
    trained, frozen = _estimate(mimo, plan=ce_mtp), _estimate(mimo, plan=ce)
    assert frozen.weights == trained.weights == 2 * (PARAMS + mtp_layer)  # built either way
    assert frozen.gradients == 4 * PARAMS and trained.gradients == 4 * (PARAMS + mtp_layer)
    assert trained.optimizer - frozen.optimizer == 12 * mtp_layer
    assert frozen.activations == _estimate(plan=ce).activations


def test_a_recipe_head_loss_comes_from_the_head_estimate(write_recipe) -> None:
    path = write_recipe(TINY_BF16)
    recipe = load_recipe(path, ["trainer.recompute=selective", "resources.gpu_memory_gib=null"])
    memory = recipe_trainer_memory(recipe)
    assert isinstance(memory, TrainerMemory)
    plan = HeadPlan.from_losses([{"kind": "ce"}])
    head = estimate_head_cost(plan, rows=8192, hidden=1024, vocab=128, param_bytes=2)
    assert memory.head_loss == head.fused_bytes
    assert (memory.recompute, memory.tokens, memory.layers) == ("selective", 8192, 8)


# A tiny model of ~122M parameters, bf16, 8192-token micro batches: ~4.5 GiB, most of it the
# activations (8 lines).
TINY_BF16 = """\
name: t
model:
  tiny: {hidden: 1024, layers: 8, heads: 8, kv_heads: 2, intermediate: 4096}
  dtype: bfloat16
data: {source: arithmetic}
resources:
  gpu_memory_gib: 4
trainer: {micro_batch_tokens: 8192}
"""


def test_validate_warns_at_gpu_memory_gib_when_the_trainer_does_not_fit(
    write_recipe, located
) -> None:
    path = write_recipe(TINY_BF16)
    with pytest.warns(RecipeWarning, match="7:19: warning: the trainer needs an estimated"):
        memory = recipe_trainer_memory(load_recipe(path))
    assert isinstance(memory, TrainerMemory) and memory.largest() == "activations"
    assert 4 * 2**30 < memory.total < 5 * 2**30
    [warning] = located(path)
    total = f"{memory.total / 2**30:.1f}"
    assert warning.startswith(
        f"{path}:7:19: warning: the trainer needs an estimated {total} GiB per rank, more than "
        "resources.gpu_memory_gib 4; activations is the largest part (weights 0.2, gradients "
        f"0.5, optimizer state 1.4, activations {memory.activations / 2**30:.1f} (recompute "
        "none), head loss 0.0 GiB;"
    )
    assert warning.endswith(
        "try trainer.recompute: full, a smaller trainer.micro_batch_tokens (now 8192) or more "
        "parallel.tp or parallel.cp (they split each micro batch)"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["resources.gpu_memory_gib=80"],  # enough memory
        ["trainer.recompute=full"],  # ~2.5 GiB
        ["trainer.micro_batch_tokens=2048"],
        ["resources.gpu_memory_gib=null"],  # no budget, no check
    ],
)
def test_no_warning_when_the_trainer_fits(write_recipe, located, overrides) -> None:
    assert located(write_recipe(TINY_BF16), overrides) == []


def test_the_warning_names_what_to_change_for_the_largest_part(write_recipe, located) -> None:
    path = write_recipe(TINY_BF16)
    # Short micro batches: the optimizer state is the largest part; bf16 moments shrink it,
    # more dp shards it.
    [warning] = located(path, ["trainer.micro_batch_tokens=256", "resources.gpu_memory_gib=1"])
    assert "optimizer state is the largest part" in warning
    assert warning.endswith(
        "try trainer.optimizer_state: bfloat16 (AdamW's moments in 4 bytes, not 8), more "
        "parallel.dp (the distributed optimizer shards its state over dp x cp) or more "
        "parallel.tp or parallel.pp"
    )
    [warning] = located(
        path,
        [
            "trainer.micro_batch_tokens=256",
            "resources.gpu_memory_gib=1",
            "trainer.optimizer_state=bfloat16",
        ],
    )
    assert warning.endswith(
        "try more parallel.dp (the distributed optimizer shards its state "
        "over dp x cp) or more parallel.tp or parallel.pp"
    )
    [warning] = located(
        path,
        ["trainer.micro_batch_tokens=256", "resources.gpu_memory_gib=1", "model.dtype=float32"],
    )
    assert warning.endswith(
        "try model.dtype: bfloat16 (bf16 weights and an optimizer state sharded over dp x cp) "
        "or more parallel.tp or parallel.pp"
    )


def test_an_unknown_model_shape_skips_the_check(write_recipe, located) -> None:
    text = TINY_BF16.replace(
        "  tiny: {hidden: 1024, layers: 8, heads: 8, kv_heads: 2, intermediate: 4096}\n",
        "  path: /nowhere/model\n",
    )
    assert located(write_recipe(text + "mask: all\n"), ["resources.gpu_memory_gib=0.001"]) == []
