"""The Megatron-core trainer against float64 transformers references, TP=2 against TP=1,
checkpoints, schedules and errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtprun.compiler import HeadPlan, compile_recipe
from mtprun.models import build_tiny_model
from mtprun.runner.net import free_port
from mtprun.runner.trainer.optim import lr_factor
from mtprun.runner.trainer.trainer import Trainer
from mtprun.spec.model import TinyModel
from mtprun.spec.parallel import ParallelSection
from mtprun.spec.trainer import TrainerSection

from .conftest import TINY, make_recipe, random_packed_batch
from .gloo_pool import gloo_pool

SGD = {"optimizer": "sgd", "lr": 1.0, "grad_clip": None}


def _batches(vocab, seed, rl=False):
    return [
        random_packed_batch(vocab, [9, 14, 6], seed=seed, rl=rl),
        random_packed_batch(vocab, [20, 4], seed=seed + 1, rl=rl),
    ]


def _hf_float64(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)


def _packed_logits(model, batch):
    """[T, V] logits of a packed batch, each sequence run on its own."""
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    return torch.cat([model(s[None]).logits[0] for s in batch.input_ids.split(lengths)])


def _reference_ce_z(model, batches, z_weight):
    """Token-mean CE + z_weight * lse^2 over all micro batches, float64, sequences unpacked."""
    ce, z, count = 0.0, 0.0, 0
    for b in batches:
        logits = _packed_logits(model, b)
        lse = logits.logsumexp(-1)
        token_ce = lse - logits.gather(-1, b.targets[:, None])[:, 0]
        ce = ce + token_ce[b.loss_mask].sum()
        z = z + lse[b.loss_mask].pow(2).sum()
        count += int(b.loss_mask.sum())
    return ce / count, z / count


def test_sgd_step_matches_float64_transformers_loss_and_gradients(megatron_tp1, tiny_qwen2_dir):
    losses = [{"kind": "ce"}, {"kind": "z_loss", "weight": 1e-2}]
    recipe = make_recipe(tiny_qwen2_dir, losses=losses, trainer=SGD)
    trainer = Trainer(recipe, tiny_qwen2_dir, compile_recipe(recipe), "cpu")
    before = trainer.hf_state_dict()
    batches = _batches(trainer.shape.vocab, seed=0)

    metrics = trainer.train_step(batches)

    reference = _hf_float64(tiny_qwen2_dir)
    ce, z = _reference_ce_z(reference, batches, 1e-2)
    (ce + 1e-2 * z).backward()
    ce, z = ce.item(), z.item()
    assert metrics["ce"] == pytest.approx(ce, rel=1e-5)
    assert metrics["z_loss"] == pytest.approx(z, rel=1e-5)
    assert metrics["loss"] == pytest.approx(ce + 1e-2 * z, rel=1e-5)
    assert metrics["tokens"] == sum(b.num_tokens for b in batches)
    assert metrics["trained_tokens"] == sum(int(b.loss_mask.sum()) for b in batches)
    assert {"entropy", "grad_norm", "lr"} <= metrics.keys()
    # SGD with lr 1 and no clipping: the update is minus the gradient.
    after = trainer.hf_state_dict()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    squares = 0.0
    for name, old in before.items():
        grad = grads[name].float()
        torch.testing.assert_close(old - after[name], grad, rtol=1e-3, atol=2e-6)
        squares += float(grad.double().pow(2).sum())
    assert metrics["grad_norm"] == pytest.approx(math.sqrt(squares), rel=1e-4)


@pytest.fixture(scope="module")
def tiny_teacher_dir(tmp_path_factory, tokenizer):
    """A wider random-init Qwen2 on the same tokenizer (so the same vocabulary)."""
    spec = TinyModel(architecture="qwen2", **(TINY | {"hidden": 96, "heads": 3, "kv_heads": 3}))
    return build_tiny_model(spec, tokenizer, tmp_path_factory.mktemp("teacher"), seed=1)


def test_distill_step_matches_float64_transformers(megatron_tp1, tiny_qwen2_dir, tiny_teacher_dir):
    distill = {"kind": "distill", "teacher": str(tiny_teacher_dir), "temperature": 2.0}
    recipe = make_recipe(
        tiny_qwen2_dir, losses=[{"kind": "ce"}, distill | {"weight": 0.5}], trainer=SGD
    )
    trainer = Trainer(recipe, tiny_qwen2_dir, compile_recipe(recipe), "cpu")
    teacher_before = copy.deepcopy(trainer.teacher.model.state_dict())
    before = trainer.hf_state_dict()
    batches = _batches(trainer.shape.vocab, seed=5)

    metrics = trainer.train_step(batches)

    student, teacher = _hf_float64(tiny_qwen2_dir), _hf_float64(tiny_teacher_dir)
    ce, soft_ce, count = 0.0, 0.0, 0
    for b in batches:
        logp = _packed_logits(student, b).log_softmax(-1)
        with torch.no_grad():
            q = (_packed_logits(teacher, b) / 2.0).softmax(-1)
        ce = ce - logp.gather(-1, b.targets[:, None])[:, 0][b.loss_mask].sum()
        soft_ce = soft_ce - (q * logp).sum(-1)[b.loss_mask].sum()
        count += int(b.loss_mask.sum())
    loss = (ce + 0.5 * soft_ce) / count
    loss.backward()
    assert metrics["distill"] == pytest.approx(float(soft_ce / count), rel=1e-5)
    assert metrics["loss"] == pytest.approx(float(loss), rel=1e-5)
    after = trainer.hf_state_dict()
    for name, param in student.named_parameters():  # SGD, lr 1: the update is -grad
        grad = param.grad.float()
        torch.testing.assert_close(before[name] - after[name], grad, rtol=1e-3, atol=2e-6)
    for name, tensor in trainer.teacher.model.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            torch.testing.assert_close(tensor, teacher_before[name], rtol=0, atol=0)


def test_a_teacher_with_another_vocabulary_is_refused(
    megatron_tp1, tiny_qwen2_dir, tokenizer, tmp_path
):
    spec = TinyModel(architecture="qwen2", **(TINY | {"vocab": 256}))
    other = build_tiny_model(spec, tokenizer, tmp_path / "teacher", seed=1)
    # Validation refuses it too when the folder is readable there (spec rule); the trainer
    # checks again where it loads it.
    plan = HeadPlan.from_losses([{"kind": "distill", "teacher": str(other)}])
    with pytest.raises(ValueError, match="vocabulary of 256 tokens and the policy one of 128"):
        Trainer(make_recipe(tiny_qwen2_dir), tiny_qwen2_dir, plan, "cpu")


def test_logprobs_match_transformers_under_the_mask(megatron_tp1, tiny_qwen2_dir):
    recipe = make_recipe(tiny_qwen2_dir)
    trainer = Trainer(recipe, tiny_qwen2_dir, compile_recipe(recipe), "cpu")
    batch = random_packed_batch(trainer.shape.vocab, [11, 17], seed=5)
    (got,) = trainer.logprobs([batch])
    reference = _hf_float64(tiny_qwen2_dir)
    with torch.no_grad():
        logits = torch.cat([reference(s[None]).logits[0] for s in batch.input_ids.split([11, 17])])
    want = logits.log_softmax(-1).gather(-1, batch.targets[:, None])[:, 0]
    want = torch.where(batch.loss_mask, want, 0.0).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_loss_falls_on_a_repeated_batch(megatron_tp1, tiny_qwen2_dir):
    recipe = make_recipe(tiny_qwen2_dir, trainer={"lr": 3e-3})
    trainer = Trainer(recipe, tiny_qwen2_dir, compile_recipe(recipe), "cpu")
    batches = _batches(trainer.shape.vocab, seed=2)
    losses = [trainer.train_step(batches)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.5
    assert trainer.step == 6


def test_checkpoint_restores_the_exact_continuation(megatron_tp1, tiny_qwen2_dir):
    recipe = make_recipe(tiny_qwen2_dir, trainer={"lr": 1e-3, "schedule": "cosine", "steps": 5})
    plan = compile_recipe(recipe)
    first = Trainer(recipe, tiny_qwen2_dir, plan, "cpu")
    batches = _batches(first.shape.vocab, seed=3)
    first.train_step(batches)
    state = copy.deepcopy(first.state_dict())  # like torch's, it holds live references
    continued = first.train_step(batches)

    second = Trainer(recipe, tiny_qwen2_dir, plan, "cpu")
    second.load_state_dict(state)
    assert second.step == 1
    assert second.train_step(batches) == continued


def test_a_checkpoint_of_other_trained_parameters_is_refused_in_the_recipes_terms(
    megatron_tp1, tiny_mimo_dir
):
    # With an mtp term the MTP layer trains; without one it is frozen: the optimizer's
    # parameter groups differ, which torch alone reports without saying why.
    adamw = {"optimizer": "adamw", "lr": 1e-3}
    with_mtp = make_recipe(tiny_mimo_dir, losses=[{"kind": "ce"}, {"kind": "mtp"}], trainer=adamw)
    first = Trainer(with_mtp, tiny_mimo_dir, compile_recipe(with_mtp), "cpu")
    first.train_step(_batches(first.shape.vocab, seed=5))
    state = copy.deepcopy(first.state_dict())
    plain = make_recipe(tiny_mimo_dir, trainer=adamw)
    second = Trainer(plain, tiny_mimo_dir, compile_recipe(plain), "cpu")
    with pytest.raises(ValueError, match=r"'policy' optimizer holds state for other.*mtp"):
        second.load_state_dict(state)


def test_mtp_draft_loss_never_reaches_the_trunk(megatron_tp1, tiny_mimo_dir):
    updates = {}
    for name, losses in {
        "ce": [{"kind": "ce"}],
        "ce+mtp": [{"kind": "ce"}, {"kind": "mtp"}],
    }.items():
        recipe = make_recipe(tiny_mimo_dir, losses=losses, trainer=SGD)
        trainer = Trainer(recipe, tiny_mimo_dir, compile_recipe(recipe), "cpu")
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        metrics = trainer.train_step(_batches(trainer.shape.vocab, seed=4))
        updates[name] = {n: before[n] - p.detach() for n, p in trainer.model.named_parameters()}
    assert "mtp/1/loss" in metrics
    for name, update in updates["ce"].items():
        if name.startswith(("decoder.", "embedding.")):
            torch.testing.assert_close(updates["ce+mtp"][name], update, rtol=0, atol=0)
    moved = updates["ce+mtp"]["mtp_layers.0.input_proj.weight"]
    assert float(moved.abs().max()) > 0
    assert float(updates["ce"]["mtp_layers.0.input_proj.weight"].abs().max()) == 0


def test_mtp_layers_that_no_term_trains_are_frozen(megatron_tp1, tiny_mimo_dir):
    """Without an mtp term the model's MTP layer is still built (exports carry it) but frozen:
    no loss reaches it, and the bf16 path's optimizer would decay it and its DDP expect its
    gradient. With the term it trains."""
    adamw = {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1}
    for losses, trains in (([{"kind": "ce"}], False), ([{"kind": "ce"}, {"kind": "mtp"}], True)):
        recipe = make_recipe(tiny_mimo_dir, losses=losses, trainer=adamw)
        trainer = Trainer(recipe, tiny_mimo_dir, compile_recipe(recipe), "cpu")
        mtp = dict(trainer.model.mtp_layers.named_parameters())
        assert mtp and {p.requires_grad for p in mtp.values()} == {trains}
        before = {name: p.detach().clone() for name, p in mtp.items()}
        trainer.train_step(_batches(trainer.shape.vocab, seed=5))
        moved = [name for name, p in mtp.items() if not torch.equal(p.detach(), before[name])]
        assert bool(moved) == trains, moved


def test_separate_mtp_optimizer_leaves_the_policy_step_unchanged(megatron_tp1, tiny_mimo_dir):
    runs = {}
    plans = {
        "ce": [{"kind": "ce"}],
        "ce+mtp": [{"kind": "ce"}, {"kind": "mtp", "separate_optimizer": True}],
        "ce+mtp shared": [{"kind": "ce"}, {"kind": "mtp"}],
    }
    for name, losses in plans.items():
        recipe = make_recipe(tiny_mimo_dir, losses=losses, trainer={"lr": 1e-2, "grad_clip": 0.1})
        trainer = Trainer(recipe, tiny_mimo_dir, compile_recipe(recipe), "cpu")
        batches = _batches(trainer.shape.vocab, seed=9)
        runs[name] = [trainer.train_step(batches) for _ in range(2)], trainer.state_dict()
    (plain, plain_state), (separate, separate_state) = runs["ce"], runs["ce+mtp"]
    for step_plain, step_separate in zip(plain, separate, strict=True):
        assert step_separate["grad_norm"] == step_plain["grad_norm"]
        assert step_separate["mtp/grad_norm"] > 0
    for name, tensor in plain_state["model"].items():
        if not name.startswith("mtp_layers.") and isinstance(tensor, torch.Tensor):
            assert torch.equal(separate_state["model"][name], tensor), name
    assert sorted(separate_state["optimizers"]) == ["mtp", "policy"]
    # Sharing one optimizer, the MTP gradients enter the policy's norm and clipping.
    shared, _ = runs["ce+mtp shared"]
    assert shared[0]["grad_norm"] > plain[0]["grad_norm"]


def test_lr_schedule_warms_up_then_decays():
    cosine = TrainerSection(lr=1.0, warmup_steps=2, steps=6, schedule="cosine")
    assert [round(lr_factor(cosine, s), 6) for s in range(7)] == [
        0.5, 1.0, 1.0, round(0.5 * (1 + math.cos(math.pi / 4)), 6), 0.5,
        round(0.5 * (1 + math.cos(3 * math.pi / 4)), 6), 0.0,
    ]  # fmt: skip
    linear = TrainerSection(lr=1.0, steps=4, schedule="linear")
    assert [lr_factor(linear, s) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]


def test_trainer_reports_the_scheduled_lr(megatron_tp1, tiny_qwen2_dir):
    recipe = make_recipe(tiny_qwen2_dir, trainer={"lr": 1e-3, "warmup_steps": 2, "steps": 4})
    trainer = Trainer(recipe, tiny_qwen2_dir, compile_recipe(recipe), "cpu")
    batch = [random_packed_batch(trainer.shape.vocab, [8], seed=6)]
    assert [trainer.train_step(batch)["lr"] for _ in range(3)] == pytest.approx([5e-4, 1e-3, 1e-3])


def test_bad_inputs_are_refused(megatron_tp1, tiny_qwen2_dir):
    recipe = make_recipe(tiny_qwen2_dir)
    trainer = Trainer(recipe, tiny_qwen2_dir, compile_recipe(recipe), "cpu")
    with pytest.raises(ValueError, match="at least one micro batch"):
        trainer.train_step([])
    with pytest.raises(ValueError, match="tp_size=2"):
        Trainer(recipe, tiny_qwen2_dir, HeadPlan.from_losses([{"kind": "ce"}], tp_size=2), "cpu")
    with pytest.raises(ValueError, match="MTP layers"):
        Trainer(recipe, tiny_qwen2_dir, HeadPlan.from_losses([{"kind": "mtp"}]), "cpu")
    context = make_recipe(tiny_qwen2_dir, parallel={"cp": 2})
    with pytest.raises(ValueError, match=r"asks for \{'tp': 1, 'pp': 1, 'cp': 2, 'dp': 1\}"):
        Trainer(context, tiny_qwen2_dir, trainer.plan, "cpu")
    with pytest.raises(ValueError, match=r"mtp terms need parallel\.cp: 1"):
        Trainer(context, tiny_qwen2_dir, HeadPlan.from_losses([{"kind": "mtp"}]), "cpu")
    whole = HeadPlan.from_losses([{"kind": "ce", "loss_agg": "seq-mean-token-mean"}])
    with pytest.raises(ValueError, match="'seq-mean-token-mean' needs whole sequences"):
        Trainer(context, tiny_qwen2_dir, whole, "cpu")
    bf16 = make_recipe(tiny_qwen2_dir, model={"path": str(tiny_qwen2_dir), "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="float32 on CPU"):
        Trainer(bf16, tiny_qwen2_dir, trainer.plan, "cpu")
    broken = random_packed_batch(trainer.shape.vocab, [8], seed=7)
    broken.cu_seqlens = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        trainer.train_step([broken])
    too_long = random_packed_batch(trainer.shape.vocab, [8, TINY["max_seq_len"] + 1], seed=7)
    with pytest.raises(ValueError, match="a packed sequence of 257 tokens is longer than the"):
        trainer.train_step([too_long])
    with pytest.raises(ValueError, match="model's 256 positions"):
        trainer.logprobs([too_long])


def test_init_parallel_refuses_a_layout_that_does_not_match_the_processes():
    from mtprun.runner.trainer.parallel import init_parallel
    from mtprun.spec.parallel import ParallelSection

    with pytest.raises(ValueError, match=r"tp\*pp\*cp\*dp = 4"):
        init_parallel(ParallelSection(tp=2, dp=2), 0, 2, "127.0.0.1", free_port())
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        init_parallel(ParallelSection(tp=2), 2, 2, "127.0.0.1", free_port())


# --- tensor, pipeline and data parallelism: two gloo processes against one ---------------

PARALLEL_LOSSES = [
    {"kind": "ce"},
    {"kind": "grpo", "kl_coef": 0.1},
    {"kind": "z_loss", "weight": 1e-3},
]


CLIPPED_SGD = {"optimizer": "sgd", "lr": 1.0, "grad_clip": 0.5, "weight_decay": 0.1}
CLIPPED_ADAMW = {"optimizer": "adamw", "lr": 1e-3, "grad_clip": 0.5, "weight_decay": 0.1}


def _train_steps(model_dir, teacher_dir, parallel, batch_ids, trainer=None, steps=2):
    """`steps` optimizer steps (clipped SGD unless `trainer` says otherwise) on RL micro
    batches `batch_ids` in an initialised process, with a distill term to `teacher_dir` (and
    an mtp term when the model has MTP layers); what this rank reports. (SGD by default, not
    Adam: Adam's normalised update turns float32 noise in near-zero gradients into lr-sized
    differences of the weights that say nothing about parallelism; Adam cases compare the
    metrics only.)"""
    distill = {"kind": "distill", "teacher": str(teacher_dir), "weight": 0.5}
    mtp = [{"kind": "mtp"}] if "mimo" in str(model_dir) else []
    recipe = make_recipe(
        model_dir,
        rl=True,
        parallel=parallel,
        losses=[*PARALLEL_LOSSES, *mtp, distill],
        trainer=trainer or CLIPPED_SGD,
    )
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cpu")
    batches = _batches(trainer.shape.vocab, seed=8, rl=True)
    mine = [batches[i] for i in batch_ids]
    metrics = [trainer.train_step(mine) for _ in range(steps)]
    return {
        "metrics": metrics,
        "logprobs": trainer.logprobs(batches[:1]),
        "state": trainer.hf_state_dict(),
        "decoder_layers": len(trainer.model.decoder.layers),
    }


def _layout_job(rank, layout, model_dir, teacher_dir, trainer, steps):
    """Rank `rank` of `layout` (a pool worker): data-parallel replicas split the step's micro
    batches, TP, CP ranks and stages share them; the last rank (the last stage, where losses
    are computed) returns what it reports."""
    from megatron.core import parallel_state

    batch_ids = [parallel_state.get_data_parallel_rank()] if layout.get("dp") == 2 else [0, 1]
    result = _train_steps(model_dir, teacher_dir, layout, batch_ids, trainer, steps)
    return result if rank == ParallelSection(**layout).world_size - 1 else None


def _train_in_processes(layout, model_dir, teacher_dir, trainer=None, steps=2):
    """What the last rank of `layout` (gloo processes) reports after `steps` steps."""
    ranks = gloo_pool().run(layout, _layout_job, model_dir, teacher_dir, trainer, steps)
    return ranks[-1]


def _assert_same_metrics(one, two):
    for step1, step2 in zip(one["metrics"], two["metrics"], strict=True):
        assert step1.keys() == step2.keys()
        for name, value in step1.items():
            assert step2[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


@pytest.fixture(scope="module")
def one_process_runs(megatron_tp1):
    """Two clipped-SGD steps of each model in this process, computed once per model and
    shared by its layouts: their reference."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallel", "model"),
    [
        ({"tp": 2}, "mimo"),
        ({"dp": 2}, "mimo"),
        ({"pp": 2}, "qwen2"),
        ({"pp": 2}, "tied"),
        ({"pp": 2}, "mimo"),
        ({"pp": 2}, "tied_mimo"),
        ({"cp": 2}, "qwen2"),
    ],
    ids=[
        "tp2",
        "dp2",
        "pp2",
        "pp2-tied",
        "pp2-mtp",
        "pp2-mtp-tied",
        "cp2",
    ],
)
def test_parallel_layouts_train_exactly_like_one_process(
    one_process_runs, tiny_qwen2_dir, request, parallel, model
):
    """Two clipped-SGD steps (with weight decay) of the RL losses, a distill term and, on MiMo
    models, an mtp term: every metric within 1e-4, the log-probs after them within 1e-5 and
    every gathered weight within 1e-4 of one process; a stage holds its share of the layers."""
    model_dir = request.getfixturevalue(f"tiny_{model}_dir")
    teacher = tiny_qwen2_dir  # same tokenizer; under TP it is split like the student
    two = _train_in_processes(parallel, model_dir, teacher)
    if model not in one_process_runs:
        one_process_runs[model] = _train_steps(model_dir, teacher, {}, [0, 1])
    one = one_process_runs[model]
    assert two["decoder_layers"] == one["decoder_layers"] // parallel.get("pp", 1)
    _assert_same_metrics(one, two)
    torch.testing.assert_close(two["logprobs"], one["logprobs"], rtol=1e-5, atol=1e-5)
    assert one["state"].keys() == two["state"].keys()
    for name, tensor in one["state"].items():
        torch.testing.assert_close(two["state"][name], tensor, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def qwen3_one_process(megatron_tp1, tiny_qwen3_dir, tiny_qwen2_dir):
    """Two AdamW steps of the Qwen3 model in this process, the reference of every layout."""
    return _train_steps(tiny_qwen3_dir, tiny_qwen2_dir, {}, [0, 1], CLIPPED_ADAMW, steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"pp": 2}], ids=["pp2"])
def test_qwen3_layouts_train_like_one_process(
    qwen3_one_process, tiny_qwen3_dir, tiny_qwen2_dir, parallel
):
    """Qwen3's per-head q/k norms need nothing of pipeline parallelism: a stage holds its
    layers' norms whole (under cp and dp their gradients are summed like every other weight's,
    as the Qwen2 layouts above check; tp, where each rank normalises only its heads:
    test_qwen3.py).
    Two AdamW steps of the RL losses with a distill term (the second reads the moments the
    first left), every metric within 1e-4, and the log-probs after them (the second update)
    within 1e-4."""
    two = _train_in_processes(parallel, tiny_qwen3_dir, tiny_qwen2_dir, CLIPPED_ADAMW, 2)
    assert two["decoder_layers"] == qwen3_one_process["decoder_layers"] // parallel.get("pp", 1)
    _assert_same_metrics(qwen3_one_process, two)
    torch.testing.assert_close(two["logprobs"], qwen3_one_process["logprobs"], rtol=1e-4, atol=1e-4)
