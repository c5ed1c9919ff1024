"""Qwen3-MoE (q/k norms, a softmax top-k router over experts, some layers dense) through
conversion, the trainer against transformers, export, and expert parallelism against one
process."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtprun.compiler import compile_recipe
from mtprun.models import ModelShape, hf_to_megatron, megatron_to_hf
from mtprun.models.expert_shape import ExpertShape
from mtprun.runner.policy_folder import save_hf_folder
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch
from .gloo_pool import gloo_pool
from .layout_check import ADAMW, check_trains_like_one_process, layout_batches
from .qwen3_folders import assert_logits_equal_transformers, build_qwen3_moe_folder


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    return build_qwen3_moe_folder(tokenizer, tmp_path_factory.mktemp("qwen3_moe"), seed=0)


def _packed_logits(model, batch):
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    return torch.cat([model(s[None]).logits[0] for s in batch.input_ids.split(lengths)])


def _hf_logprobs(model_dir, batch, dtype=torch.float64):
    # transformers' default grouped GEMM takes no float64: its loop over experts does.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        logp = _packed_logits(model, batch).log_softmax(-1)
    want = logp.gather(-1, batch.targets[:, None])[:, 0]
    return torch.where(batch.loss_mask, want, 0.0).float()


def test_shape_reads_the_experts_and_the_dense_layers(moe_dir):
    shape = ModelShape.from_model_dir(moe_dir)
    assert shape.architecture == "Qwen3MoeForCausalLM" and shape.qk_norm
    assert shape.experts == ExpertShape(count=4, top_k=2, intermediate=32, dense_layers=(0,))
    assert [shape.is_moe_layer(i) for i in range(shape.layers)] == [False, True]


def test_converts_both_ways_exactly_and_computes_transformers_logits(megatron_tp1, moe_dir):
    from mtprun.runner.trainer.model import PolicyModel, load_megatron_weights

    shape = ModelShape.from_model_dir(moe_dir)
    hf = load_file(moe_dir / "model.safetensors")
    # Two expert-parallel shards hold two experts each; together they are the checkpoint.
    shards = [hf_to_megatron(hf, shape, ep_rank=r, ep_size=2) for r in (0, 1)]
    weight1 = "decoder.layers.1.mlp.experts.weight1"
    assert shards[1][weight1].shape == (2, 64, 64)
    full = {
        n: torch.cat([s[n] for s in shards]) if "experts." in n else t for n, t in shards[0].items()
    }
    back = megatron_to_hf(full, shape)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name

    model = PolicyModel(shape)
    load_megatron_weights(model, hf_to_megatron(hf, shape))
    assert_logits_equal_transformers(model, moe_dir)


def test_trainer_logprobs_and_export_equal_transformers(megatron_tp1, moe_dir, tmp_path):
    recipe = make_recipe(moe_dir, trainer=ADAMW)
    trainer = Trainer(recipe, moe_dir, compile_recipe(recipe), "cpu")
    batch = random_packed_batch(trainer.shape.vocab, [11, 17], seed=5)
    (got,) = trainer.logprobs([batch])
    torch.testing.assert_close(got, _hf_logprobs(moe_dir, batch), rtol=1e-4, atol=1e-4)

    trainer.train_step([batch, random_packed_batch(trainer.shape.vocab, [9, 6], seed=6)])
    exported = save_hf_folder(trainer.hf_state_dict(), moe_dir, tmp_path / "export")
    saved, before = (
        load_file(exported / "model.safetensors"),
        load_file(moe_dir / "model.safetensors"),
    )
    assert saved.keys() == before.keys()
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert not torch.equal(saved[expert], before[expert])
    # transformers loads the export and scores the batch as the trained policy does.
    (trained,) = trainer.logprobs([batch])
    torch.testing.assert_close(trained, _hf_logprobs(exported, batch), rtol=1e-4, atol=1e-4)


# cp with experts runs the same routing code as dp (each rank routes its own tokens): the
# dense models' cp case covers the rest (tests/runner/test_trainer.py).
LAYOUTS = [{"dp": 2, "ep": 2}, {"pp": 2}, {"tp": 2, "dp": 2, "ep": 2}]


@pytest.fixture(scope="module")
def one_process(megatron_tp1):
    """One-process runs by model folder, the reference of every layout (`layout_check`)."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=["dp2ep2", "pp2", "tp2dp2ep2"])
def test_layouts_train_like_one_process(one_process, moe_dir, layout):
    """dp=2 with ep=2 (each rank two of the four experts and its own micro batch), pp=2 (a
    dense and a sparse stage) and tp=2 with dp=2 and ep=2 on four processes (attention split,
    each tp rank routing half of the tokens to whole experts)."""
    metrics = check_trains_like_one_process(moe_dir, layout, one_process)
    if "ep" not in layout:
        assert "moe/ep_load_max_over_mean" not in metrics[0]
    elif "tp" not in layout:  # (tp's routers also count the rows padding the token split)
        # The first step routes with the loaded weights: both replicas' batches, ranks
        # holding experts {0, 1} and {2, 3}.
        vocab = ModelShape.from_model_dir(moe_dir).vocab
        counts = sum(_router_reference(moe_dir, b, top_k=2)[3] for b in layout_batches(vocab))
        per_rank = counts.view(2, 2).sum(1)
        busiest = (per_rank.max() / per_rank.mean()).item()
        assert metrics[0]["moe/ep_load_max_over_mean"] == pytest.approx(busiest, rel=1e-6)


def _uneven_replicas_job(rank: int, layout: dict[str, int], model_dir):
    """Replica 0 trains three micro batches, one without trained tokens; replica 1 one."""
    batches = _uneven_batches(ModelShape.from_model_dir(model_dir).vocab)
    result = _two_steps(model_dir, layout, batches[:3] if rank == 0 else batches[3:])
    return result if rank == 1 else None


def _uneven_batches(vocab: int) -> list:
    batches = [random_packed_batch(vocab, n, seed=i) for i, n in enumerate([[9, 14], [12], [30]])]
    batches[1].loss_mask[:] = False  # e.g. an overlong rollout's, masked whole
    return [*batches, random_packed_batch(vocab, [17, 8], seed=3)]


def _two_steps(model_dir, layout, batches):
    """Two steps on `batches`: the metrics, the weights, and the last batch's log-probs."""
    recipe = make_recipe(model_dir, parallel=layout, trainer=ADAMW)
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cpu")
    metrics = [trainer.train_step(batches) for _ in range(2)]
    return metrics, trainer.hf_state_dict(), trainer.logprobs(batches)[-1]


@pytest.mark.slow
def test_expert_parallel_replicas_with_uneven_micro_batches_train_like_one_process(
    megatron_tp1, moe_dir
):
    """dp = 2, ep = 2 whose replicas train 3 and 1 micro batches, one of them without trained
    tokens: every rank runs as many (the short one copies of its last, which train nothing)
    and none skips one that another exchanges tokens with at its MoE layer (each would leave
    the other rank's all-to-all without a peer); so do their log-probs. Losses, gradient
    norms, routing metrics, weights and the last batch's log-probs equal one process training
    the four."""
    job = _uneven_replicas_job
    two, two_weights, two_logprobs = gloo_pool().run({"dp": 2, "ep": 2}, job, moe_dir)[-1]
    vocab = ModelShape.from_model_dir(moe_dir).vocab
    one, one_weights, one_logprobs = _two_steps(moe_dir, {}, _uneven_batches(vocab))
    torch.testing.assert_close(two_logprobs, one_logprobs, rtol=1e-4, atol=1e-5)
    for step1, step2 in zip(one, two, strict=True):
        for name in ("loss", "grad_norm", "tokens", "trained_tokens", "moe/load_max_over_mean"):
            assert step2[name] == pytest.approx(step1[name], rel=1e-4), name
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, rtol=1e-3, atol=1e-4)


def _router_reference(model_dir, batch, top_k):
    """Float64 transformers: the sparse layer's router input (captured by a hook), its
    router weight, and the aux loss E / (k T^2) sum_e n_e S_e and busiest-over-mean load of
    the batch's routing, with the aux loss's gradient to the router weight and the tokens
    each expert got."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    router = model.model.layers[1].mlp.gate
    seen = []
    handle = router.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    with torch.no_grad():
        _packed_logits(model, batch)
    handle.remove()
    hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h in seen])
    weight = router.weight.detach().clone().requires_grad_(True)
    scores = (hidden @ weight.T).softmax(-1)
    chosen = torch.zeros_like(scores).scatter_(1, scores.topk(top_k, -1).indices, 1.0)
    tokens, experts = scores.shape
    counts = chosen.sum(0)
    aux = experts / (top_k * tokens**2) * (counts * scores.sum(0)).sum()
    (grad,) = torch.autograd.grad(aux, weight)
    return aux.item(), (counts.max() / counts.mean()).item(), grad, counts


@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_router_metrics_and_aux_loss_gradient_equal_float64(megatron_tp1, moe_dir, coef):
    """One micro batch, no clipping: the step reports the batch's routing (load and aux
    loss) and, with a router_aux term of weight w, the router weight's gradient moves by
    exactly w d(aux)/dW."""
    losses = [{"kind": "ce"}] + ([{"kind": "router_aux", "weight": coef}] if coef else [])
    recipe = make_recipe(moe_dir, trainer={**ADAMW, "grad_clip": None}, losses=losses)
    trainer = Trainer(recipe, moe_dir, compile_recipe(recipe), "cpu")
    batch = random_packed_batch(trainer.shape.vocab, [21, 30, 13], seed=3)
    batch.loss_mask[:] = True  # the router sees every token; the head's mask does not matter
    router = trainer.model.decoder.layers[1].mlp.router.weight
    metrics = trainer.train_step([batch])
    aux, load, grad, _ = _router_reference(moe_dir, batch, top_k=2)
    assert metrics["moe/aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert metrics["moe/load_max_over_mean"] == pytest.approx(load, rel=1e-6)
    assert "moe/ep_load_max_over_mean" not in metrics  # one process: no ranks to wait
    if coef:
        plain = make_recipe(moe_dir, trainer={**ADAMW, "grad_clip": None})
        without = Trainer(plain, moe_dir, compile_recipe(plain), "cpu")
        without.train_step([batch])
        base = without.model.decoder.layers[1].mlp.router.weight.grad
        torch.testing.assert_close(router.grad - base, coef * grad.float(), rtol=1e-4, atol=1e-6)


def test_a_config_that_contradicts_the_weights_names_both(moe_dir):
    shape = ModelShape.from_model_dir(moe_dir)
    hf = load_file(moe_dir / "model.safetensors")
    extra = hf["model.layers.1.mlp.experts.0.gate_proj.weight"]
    with pytest.raises(ValueError, match=r"4 routed experts .*experts\.4\.gate_proj"):
        hf_to_megatron({**hf, "model.layers.1.mlp.experts.4.gate_proj.weight": extra}, shape)
    fewer = {n: t for n, t in hf.items() if ".experts.3." not in n}
    with pytest.raises(KeyError, match=r"experts\.3\..*does config.json match the weights"):
        hf_to_megatron(fewer, shape)


class _ReadLog(dict):
    """The checkpoint's tensors, recording every name conversion reads."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_reads_only_its_own_experts(moe_dir, rank):
    shape = ModelShape.from_model_dir(moe_dir)
    hf = _ReadLog(load_file(moe_dir / "model.safetensors"))
    hf_to_megatron(hf, shape, ep_rank=rank, ep_size=2)
    read = {int(n.split(".experts.")[1].split(".")[0]) for n in hf.read if ".experts." in n}
    assert read == {2 * rank, 2 * rank + 1}
    assert {n for n in hf if ".experts." not in n} <= hf.read  # the rest is read whole

    # A missing expert fails on the rank that holds it, and only there; a tensor of an expert
    # past the config's count fails on every rank.
    fewer = {n: t for n, t in hf.items() if ".experts.3." not in n}
    if rank == 0:
        hf_to_megatron(fewer, shape, ep_rank=rank, ep_size=2)
    else:
        with pytest.raises(KeyError, match=r"experts\.3\."):
            hf_to_megatron(fewer, shape, ep_rank=rank, ep_size=2)
    extra = {**hf, "model.layers.1.mlp.experts.4.up_proj.weight": hf[next(iter(hf))]}
    with pytest.raises(ValueError, match=r"experts\.4\.up_proj"):
        hf_to_megatron(extra, shape, ep_rank=rank, ep_size=2)


def test_moe_layers_run_after_a_vllm_engine_replaced_torch_streams(megatron_tp1, moe_dir):
    """vLLM's CPU worker replaces torch.cuda.Stream at import (an engine earlier in the same
    process, as in this suite); the trainer's CPU shims, applied again by every init_parallel,
    give the MoE dispatcher back its stream (its side stream once held vLLM's placeholder,
    whose events are None)."""
    import vllm.v1.worker.cpu.shm  # noqa: F401
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from mtprun.runner.trainer.cpu_shims import apply_cpu_shims
    from mtprun.runner.trainer.model import PolicyModel, load_megatron_weights

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # as in a process's first MoE layer
    apply_cpu_shims()
    shape = ModelShape.from_model_dir(moe_dir)
    model = PolicyModel(shape)
    load_megatron_weights(model, hf_to_megatron(load_file(moe_dir / "model.safetensors"), shape))
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream.record_event() is not None
    ids = torch.randint(0, shape.vocab, (1, 8))
    causal = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        assert model.eval()(ids, torch.arange(8)[None], causal).shape == (1, 8, shape.vocab)
