"""megatron-core's DDP with `overlap_grad_reduce` (`mixed_precision.MainGrads`) on gloo: the
float32 main gradients of several micro batches summed over two ranks of a parallel layout
equal one process's, with every parameter counted ready once in the
last micro batch's backward (none missed: every bucket's reduce-scatter started before
`finish`; none twice: refused).

The bf16 trainer runs this path on CUDA only (megatron-core's optimizer needs it); here it
wraps the float32 CPU trainer's model, with the token embedding's and the output layer's
gradients added into main_grad outside autograd as on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mtprun.compiler import compile_recipe
from mtprun.models.pp_layout import global_tensors
from mtprun.models.tp_layout import gather_state_dict
from mtprun.runner.trainer.trainer import Trainer, _trained_sequences

from .conftest import make_recipe, random_packed_batch
from .gloo_pool import gloo_pool
from .qwen3_5_folders import build_qwen3_5_folder
from .qwen3_folders import build_qwen3_moe_folder

MICRO_BATCHES = 4  # two a replica at dp=2: the first runs under no_sync


def _micro_batches(vocab: int) -> list:
    lengths = [[9, 14, 6], [20, 4], [11, 7, 5], [16]]
    return [random_packed_batch(vocab, n, seed=30 + i) for i, n in enumerate(lengths)]


def _dispatched(ddp) -> int:
    """Bucket groups whose reduce-scatter is in flight."""
    groups = ddp.bucket_groups + ddp.expert_parallel_bucket_groups
    return sum(g.grad_reduce_handle is not None for g in groups)


def _gather_buckets(ddp) -> None:
    """Every rank's reduced slice of every bucket into every rank's buffer (what the
    distributed optimizer's all-gather does for the weights)."""
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        size = group.intra_distributed_optimizer_instance_size
        rank = group.intra_distributed_optimizer_instance_rank
        for bucket in group.buckets:
            shard = bucket.grad_data.view(size, -1)[rank].clone()
            dist.all_gather_into_tensor(
                bucket.grad_data, shard, group=group.intra_distributed_optimizer_instance_group
            )


def _main_grads_job(rank: int, layout: dict[str, int], model_dir, sections, steps: int):
    """Rank `rank` of `layout` (a pool worker): `steps` backwards over this replica's micro
    batches (its share of their tokens under cp), each weighted by its share of all the
    replicas' trained tokens, through MainGrads with buckets of a quarter of the model
    (`sections`: the recipe's other sections). A tied embedding split over pipeline stages
    is summed over them before `finish`, and the tensor-parallel ranks' partial gradients
    after it, as the trainer does.

    Returns, per step, the in-flight bucket groups at each micro batch's forward and after
    the backward (before `finish`); the number of bucket groups and of those that wait for
    `finish` (holding that embedding); the summed main gradients after the last step under
    whole-model names (the routed experts': their first expert and count), and the tied
    output-layer copy's, if any."""
    from megatron.core import parallel_state

    from mtprun.runner.trainer.mixed_precision import MainGrads
    from mtprun.runner.trainer.model import sum_partial_grads
    from mtprun.runner.trainer.pipeline import run_micro_batches

    recipe = make_recipe(model_dir, parallel=layout, **sections)
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cpu")
    batches = _micro_batches(trainer.shape.vocab)
    total = sum(int(b.loss_mask.sum()) for b in batches)
    rate = total / sum(_trained_sequences(b) for b in batches)
    dp, dp_rank = layout.get("dp", 1), parallel_state.get_data_parallel_rank()
    items = [
        (b, int(b.loss_mask[trainer._shard(b).index].sum()) / total, rate)
        for b in batches[dp_rank::dp]
    ]
    size = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    held = trainer._split_tied_weight()
    grads = MainGrads(trainer.model, [held] if held is not None else [], bucket_size=size // 4)
    all_groups = grads.ddp.bucket_groups + grads.ddp.expert_parallel_bucket_groups
    waiting = sum(held in g.params for g in all_groups)
    seen = []
    for _ in range(steps):
        grads.zero()
        at_forward = []

        def step(item, at_forward=at_forward):
            at_forward.append(_dispatched(grads.ddp))
            return trainer._train_micro_batch(item)

        run_micro_batches(trainer.model, items, step)
        seen.append((at_forward, _dispatched(grads.ddp)))
        if held is not None:
            dist.all_reduce(held.main_grad, group=parallel_state.get_embedding_group())
        grads.finish()
        sum_partial_grads(trainer.model, trainer.tp_group)
    _gather_buckets(grads.ddp)
    trained = trainer.model.named_parameters()
    local = {n: p.main_grad for n, p in trained if hasattr(p, "main_grad")}
    full = gather_state_dict(local, trainer.tp_size, trainer.tp_group)
    summed = global_tensors(full, trainer.shape, trainer.stage)
    copy = held.main_grad.clone() if held is not None and trainer.stage.last else None
    experts = trainer.shape.experts.count // trainer.ep_size if trainer.shape.experts else 0
    first = parallel_state.get_expert_model_parallel_rank() * experts
    return seen, (len(all_groups), waiting), summed, (first, experts), copy


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    return build_qwen3_moe_folder(tokenizer, tmp_path_factory.mktemp("qwen3_moe"), seed=0)


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory, tokenizer):
    return build_qwen3_5_folder(tokenizer, tmp_path_factory.mktemp("qwen3_5"), seed=0)


# Selective recomputation: the MLPs' weights get their gradients in a nested backward.
SELECTIVE = {"trainer": {"recompute": "selective"}}
MTP = {"losses": [{"kind": "ce"}, {"kind": "mtp"}]}
LORA = {"lora": {"rank": 4, "alpha": 12, "targets": ["all"]}}  # model.lora, base frozen
CASES = [
    pytest.param("tiny_qwen3_dir", {"dp": 2}, SELECTIVE, id="untied-dp2-selective"),
    pytest.param("tiny_tied_dir", {"dp": 2}, {}, id="tied-dp2"),
    pytest.param("tiny_qwen3_dir", {"cp": 2}, {}, id="cp2"),
    pytest.param("tiny_mimo_dir", {"dp": 2}, MTP, id="mtp-dp2"),
    pytest.param("moe_dir", {"dp": 2, "ep": 2}, {}, id="moe-dp2ep2"),
    pytest.param("tiny_qwen3_dir", {"pp": 2}, {}, id="pp2"),
    pytest.param("tiny_tied_dir", {"pp": 2}, {}, id="tied-pp2"),
    pytest.param("tiny_qwen3_dir", {"tp": 2}, {}, id="tp2"),
    pytest.param("tiny_qwen3_dir", {"dp": 2}, LORA, id="lora-dp2"),
    pytest.param("qwen3_5_dir", {"dp": 2}, {}, id="qwen3_5-dp2"),
]


@pytest.mark.parametrize(("folder", "layout", "sections"), CASES)
def test_two_ranks_sum_main_grads_like_one_process_during_the_backward(
    folder, layout, sections, request
):
    """Two data-parallel replicas (each two of the four micro batches), two context-parallel
    ranks (each half of every micro batch's tokens), two pipeline stages (the 1F1B schedule's
    no_sync; a tied embedding held for the stages' sum), two tensor-parallel ranks; the MTP
    layers trained by their loss; the routed experts in megatron-core's expert-data-parallel
    buffers; LoRA adapters on a frozen base; Qwen3.5's Gated DeltaNet layers."""
    model_dir = request.getfixturevalue(folder)
    if "lora" in sections:
        sections = {"model": {"path": str(model_dir), "lora": sections["lora"]}}
    (one,) = gloo_pool().run({}, _main_grads_job, model_dir, sections, 1)
    _, _, want, _, _ = one
    ranks = gloo_pool().run(layout, _main_grads_job, model_dir, sections, 2)
    assert set().union(*(got.keys() for _, _, got, _, _ in ranks)) == want.keys()
    assert any(groups > 1 for _, (groups, _), _, _, _ in ranks)
    for seen, (groups, waiting), got, (first, count), copy in ranks:
        (first_forwards, first_backward), (forwards, backward) = seen
        # No reduce-scatter before the last micro batch's backward; megatron-core's first
        # step only learns the counts, the second starts every bucket during the backward:
        # none waited for `finish` to count a parameter that the backward missed.
        expect = [0] * (MICRO_BATCHES // layout.get("dp", 1))
        assert first_forwards == forwards == expect
        assert first_backward == 0 and backward == groups - waiting
        for name, grad in got.items():
            expected = want[name]
            if count and ".experts." in name:
                expected = expected[first : first + count]
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=name)
        if copy is not None:
            embedding = want["embedding.word_embeddings.weight"]
            torch.testing.assert_close(copy, embedding, rtol=1e-5, atol=1e-6)


def test_a_parameter_counted_twice_is_refused(megatron_tp1, tiny_qwen3_dir):
    """A gradient that reached main_grad both through autograd and outside it would be
    counted twice, starting its bucket's sum before the second part lands."""
    from mtprun.runner.trainer.mixed_precision import MainGrads

    recipe = make_recipe(tiny_qwen3_dir)
    trainer = Trainer(recipe, tiny_qwen3_dir, compile_recipe(recipe), "cpu")
    grads = MainGrads(trainer.model)
    weight = trainer.model.output_layer.weight
    grads.zero()
    weight.main_grad_ready()
    with pytest.raises(RuntimeError, match="counted ready twice"):
        weight.main_grad_ready()
