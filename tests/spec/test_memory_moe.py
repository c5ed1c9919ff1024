"""The trainer's memory per rank for mixture-of-experts models (mtprun.preflight.memory): the
router and this rank's experts per sparse layer, dense layers' MLPs, the expert optimizer state
sharded over the expert-data-parallel group, the dispatched copies of each token, and the
estimate against issue 24's GPU measurements (bench/RESULTS.md)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mtprun.compiler import HeadPlan
from mtprun.compiler.estimate import estimate_head_cost
from mtprun.models.expert_shape import ExpertShape
from mtprun.models.shape import ModelShape
from mtprun.preflight import load_recipe
from mtprun.preflight.memory import (
    GIB,
    TrainerMemory,
    estimate_trainer_memory,
    layer_params,
    moe_layer_params,
    parameters,
    recipe_trainer_memory,
)
from mtprun.preflight.memory_advice import over_budget_message
from mtprun.spec.parallel import ParallelSection

# Qwen3-30B-A3B's config.json (the fields the shape reads).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}

# By hand, one layer: q/k/v 2048 x (4096 + 2 x 512), o 4096 x 2048, two RMSNorms, q/k norms.
ATTENTION = 2048 * (4096 + 1024) + 4096 * 2048 + 2 * 2048 + 2 * 128  # 18,878,720
ROUTER = 128 * 2048
EXPERT = 3 * 2048 * 768  # gate, up, down
EMBEDDING = 151936 * 2048
CE = HeadPlan.from_losses([{"kind": "ce"}], tp_size=1)


def _shape(**config) -> ModelShape:
    return ModelShape.from_hf_config({**QWEN3_30B_A3B, **config})


def _estimate(shape: ModelShape, tokens: int = 16384, **options) -> TrainerMemory:
    layout = {k: options.pop(k) for k in ("tp", "pp", "cp", "dp", "ep") if k in options}
    return estimate_trainer_memory(
        shape,
        ParallelSection(**layout),
        dtype=options.pop("dtype", "bfloat16"),
        micro_batch_tokens=tokens,
        **options,
    )


def test_qwen3_30b_a3b_has_30_5b_parameters_by_hand() -> None:
    shape = _shape()
    assert shape.experts == ExpertShape(count=128, top_k=8, intermediate=768)
    assert moe_layer_params(shape, tp=1, ep=1) == (ATTENTION + ROUTER, 128 * EXPERT)
    assert moe_layer_params(shape, tp=1, ep=8) == (ATTENTION + ROUTER, 16 * EXPERT)
    total = 48 * (ATTENTION + ROUTER + 128 * EXPERT) + 2 * EMBEDDING + 2048
    assert parameters(shape) == total == 30_532_122_624  # the model card's 30.5B
    # Active per token: attention, router and 8 of the 128 experts a layer (the card's 3.3B).
    active = 48 * (ATTENTION + ROUTER + 8 * EXPERT) + 2 * EMBEDDING + 2048
    assert 3.3e9 < active < 3.4e9


def test_weights_gradients_and_optimizer_state_of_one_rank_by_hand() -> None:
    shape = _shape()
    replicated = 48 * (ATTENTION + ROUTER) + 2 * EMBEDDING + 2048
    experts = 48 * 16 * EXPERT  # 16 of 128 experts a layer on each of 8 expert-parallel ranks
    memory = _estimate(shape, dp=8, ep=8)
    assert (memory.experts_per_rank, memory.sparse_layers) == (16, 48)
    assert memory.expert_params == experts
    assert memory.weights == 2 * (replicated + experts)
    assert memory.gradients == 4 * (replicated + experts)
    # Master weights and two float32 moments (12 bytes): the replicated parameters' over the 8
    # data-parallel ranks, the experts' over dp / ep = 1 rank (no other rank holds them).
    assert (memory.optimizer_shards, memory.expert_optimizer_shards) == (8, 1)
    assert memory.optimizer == -(-12 * replicated // 8) + 12 * experts
    # dp 16, ep 8: two ranks hold each expert and split its state.
    wider = _estimate(shape, dp=16, ep=8)
    assert wider.expert_optimizer_shards == 2
    assert wider.optimizer == -(-12 * replicated // 16) + 12 * experts // 2
    # float32 weights train with torch.optim: not sharded, but only this rank's experts.
    fp32 = _estimate(shape, dp=8, ep=8, dtype="float32")
    assert fp32.optimizer == 8 * (replicated + experts) and fp32.expert_optimizer_shards == 1


def test_dense_layers_keep_the_dense_mlp() -> None:
    # decoder_sparse_step 2: layers 1, 3, ... are sparse; mlp_only_layers makes more dense.
    shape = _shape(decoder_sparse_step=2, mlp_only_layers=[1])
    assert shape.experts.dense_layers == (0, 1, *range(2, 48, 2))
    dense = layer_params(shape, tp=1)
    assert dense == ATTENTION + 3 * 2048 * 6144
    sparse = 23
    assert parameters(shape) == (
        (48 - sparse) * dense + sparse * (ATTENTION + ROUTER + 128 * EXPERT) + 2 * EMBEDDING + 2048
    )
    memory = _estimate(shape, dp=2, ep=2, pp=2)
    # Stage 0 holds layers 0-23 (11 sparse: 3, 5, ..., 23), stage 1 layers 24-47 (12 sparse).
    assert memory.sparse_layers in (11, 12) and memory.expert_params == memory.sparse_layers * (
        64 * EXPERT
    )


SMALL = ModelShape(
    hidden=64,
    layers=3,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    vocab=1000,
    qkv_bias=False,
    experts=ExpertShape(count=8, top_k=2, intermediate=32, dense_layers=(0,)),
)
# Per token, bf16: the attention part of a layer (norms 4 x 64, q 64, k and v 2 x 32, attention
# output and projection input 2 x 64) x 2 bytes + the float32 log-sum-exp of 4 heads.
ATTENTION_ACTS = (256 + 64 + 64 + 128) * 2 + 4 * 4  # 1040
DENSE_MLP_ACTS = 3 * 128 * 2  # fc1 output and SwiGLU product
# Two dispatched copies: expert input 64, fc1 output 2 x 32, SwiGLU output 32, its weighted
# copy 32, the probability 1 (bf16); routing: two bool maps of 8 experts, float32 top-2 scores,
# int64 top-2 and permutation indices.
EXPERT_ACTS = 2 * (64 + 64 + 32 + 32 + 1) * 2 + 2 * 8 + 2 * (4 + 8 + 8)  # 828
FINAL_NORM = 2 * 64 * 2


def test_activations_of_sparse_and_dense_layers_by_hand() -> None:
    tokens = 1024
    none = _estimate(SMALL, tokens)
    assert none.activations == tokens * (
        ATTENTION_ACTS + DENSE_MLP_ACTS + 2 * (ATTENTION_ACTS + EXPERT_ACTS) + FINAL_NORM
    )
    # Selective recomputation is megatron-core's MLP recomputation, which skips MoE layers.
    selective = _estimate(SMALL, tokens, recompute="selective")
    assert none.activations - selective.activations == tokens * DENSE_MLP_ACTS
    # Full: each layer's input, and the largest layer (a sparse one) while it reruns.
    full = _estimate(SMALL, tokens, recompute="full")
    assert full.activations == tokens * (3 * 64 * 2 + FINAL_NORM + ATTENTION_ACTS + EXPERT_ACTS)
    # A shared expert adds a dense MLP of its width to every sparse layer's activations.
    shared = replace(SMALL, experts=replace(SMALL.experts, shared_intermediate=64))
    assert _estimate(shared, tokens).activations - none.activations == tokens * 2 * 3 * 64 * 2


# bench/RESULTS.md, "Model families ... (issue 24)": Qwen3-30B-A3B's shape cut to layers, one
# 16384-token micro batch (4 x 4096), bf16 weights, float32 moments, recompute none, CE; peak
# allocated GiB of a rank (torch.cuda.max_memory_allocated).
MEASURED = {
    "4 layers, one H100 (run57)": (4, {}, 62.1),
    "8 layers, dp 2, ep 2, a rank (run58, two H200)": (8, {"dp": 2, "ep": 2}, 69.1),
}


@pytest.mark.parametrize("case", list(MEASURED))
def test_the_estimate_is_a_close_floor_of_the_gpu_measurements(case: str) -> None:
    layers, layout, measured_gib = MEASURED[case]
    shape = _shape(num_hidden_layers=layers)
    memory = _estimate(shape, plan=CE, **layout)
    estimate = memory.total / GIB
    # 4 layers: 60.5 GiB (97.4%); 8 layers, ep 2: 65.1 GiB (94.2%). What is left out: the CUDA
    # context is not in the measurement; transients (the dispatcher's permuted copies, backward's
    # gradients of one layer, all-to-all buffers) and allocator slack are.
    assert 0.93 * measured_gib < estimate < measured_gib, f"{estimate:.1f} GiB"
    # The old dense reading (every layer a 6144-wide MLP) was 3-4x under.
    dense = _estimate(replace(shape, experts=None), plan=CE, **layout)
    assert dense.total / GIB < measured_gib / 3
    # Each part as counted.
    head = estimate_head_cost(CE, rows=16384, hidden=2048, vocab=151936, param_bytes=2)
    assert memory.head_loss == head.fused_bytes
    per_layer = (
        (4 * 2048 + 4096 + 2 * 512 + 2 * 4096) * 2
        + 4 * 32
        + 8 * (2048 + 4 * 768 + 1) * 2
        + 2 * 128
        + 8 * 20
    )
    assert memory.activations == 16384 * (layers * per_layer + 2 * 2048 * 2)


def test_the_fit_message_of_a_moe_model_suggests_expert_parallelism() -> None:
    memory = _estimate(_shape(), dp=2, ep=2, tokens=4096, recompute="full")
    assert memory.largest() == "optimizer"
    message = over_budget_message(memory, "80 GiB", 4096)
    assert message.endswith(
        "try trainer.optimizer_state: bfloat16 (AdamW's moments in 4 bytes, not 8), more "
        "parallel.ep (each rank now holds 64 experts of every sparse layer; ep divides dp, so "
        "raise dp with it) or more parallel.pp"
    )
    assert "parallel.tp" not in message  # tp keeps whole experts on every rank
    gradients = _estimate(_shape(), dp=8, ep=2, tokens=4096, recompute="full")
    assert gradients.largest() == "gradients"
    assert over_budget_message(gradients, "80 GiB", 4096).endswith(
        "try more parallel.ep (each rank now holds 64 experts of every sparse layer; ep "
        "divides dp, so raise dp with it) or more parallel.pp"
    )
    activations = _estimate(_shape(num_hidden_layers=4), dp=8, ep=8, tokens=65536)
    assert activations.largest() == "activations"
    assert over_budget_message(activations, "80 GiB", 65536).endswith(
        "try trainer.recompute: full, a smaller trainer.micro_batch_tokens (now 65536) or more "
        "parallel.tp or parallel.cp (they split each micro batch)"
    )


def test_a_recipe_on_the_config_counts_its_parallel_ep(tmp_path, write_recipe) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    path = write_recipe(
        f"name: q\nmodel: {{path: {tmp_path}, dtype: bfloat16}}\n"
        "data: {source: arithmetic, template: chatml}\n"
        "parallel: {dp: 8, ep: 8}\ntrainer: {micro_batch_tokens: 8192, recompute: full}\n"
        "resources: {num_gpus: 8, gpu_memory_gib: 80}\n"
    )
    recipe = load_recipe(path)
    memory = recipe_trainer_memory(recipe)
    assert isinstance(memory, TrainerMemory)
    assert memory == _estimate(
        _shape(), 8192, dp=8, ep=8, recompute="full", plan=HeadPlan.from_losses([{"kind": "ce"}])
    )
    assert 70 < memory.total / GIB < 80  # 74.3 GiB: fits an 80 GiB card, as a floor


def test_a_recipe_with_router_terms_is_still_held_to_its_gpu_memory(write_recipe, located) -> None:
    path = write_recipe(
        "name: t\nmodel: {tiny: {architecture: qwen3_moe, hidden: 128, heads: 4}}\n"
        "data: {source: arithmetic}\n"
        "losses: [{kind: ce}, {kind: router_aux, weight: 0.001}]\n"
        "resources: {gpu_memory_gib: 0.001}\n"
    )
    (message,) = located(path)
    assert "resources.gpu_memory_gib" in message or "more than resources.gpu_memory_gib" in message


def test_tp_keeps_whole_experts_and_routes_a_share_of_the_tokens() -> None:
    """Under tp the attention splits as in a dense model, every rank holds whole experts and
    routes 1/tp of the tokens (`TensorParallelMoELayer`)."""
    one, two = _estimate(_shape(), tokens=8192), _estimate(_shape(), tokens=8192, tp=2)
    assert two.expert_params == one.expert_params
    assert two.weights < one.weights  # the attention and the output layer are split
    assert two.activations < one.activations
