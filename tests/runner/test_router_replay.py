"""Router replay (trainer.router_replay) through the real trainer on a tiny Qwen3-MoE (layer 0
dense, layer 1 with 4 experts, top 2): the router's routing map is the given routing on
tokens that have one and its own choice elsewhere, and the trainer's log-probs then equal
float64 transformers forced to the same routing; recomputation replays the same routing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtprun.compiler import compile_recipe
from mtprun.data.batch import PackedBatch
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch
from .qwen3_folders import build_qwen3_moe_folder

ADAMW = {"optimizer": "adamw", "lr": 1e-3, "grad_clip": None}
LENGTHS = [11, 17, 9]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    return build_qwen3_moe_folder(tokenizer, tmp_path_factory.mktemp("qwen3_moe"), seed=0)


def _replay_trainer(moe_dir, **trainer):
    recipe = make_recipe(
        moe_dir,
        rl=True,
        trainer={**ADAMW, "router_replay": True, **trainer},
        losses=[{"kind": "grpo"}],
    )
    return Trainer(recipe, moe_dir, compile_recipe(recipe), "cpu")


def _with_forced_routing(batch: PackedBatch, seed: int) -> PackedBatch:
    """Random top-2 experts of layer 1 per token (layer 0 is dense: its rows stay 0, as vLLM
    leaves them), every fifth token without a routing (-1)."""
    g = torch.Generator().manual_seed(seed)
    tokens = batch.num_tokens
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(tokens)])
    routed = torch.zeros(tokens, 2, 2, dtype=torch.int16)
    routed[:, 1] = experts.to(torch.int16)
    routed[::5] = -1
    batch.routed_experts = routed
    return batch


def _routing_maps(trainer):
    """The routing map [T, E] the layer-1 router returns on each call."""
    maps = []
    router = trainer.model.decoder.layers[1].mlp.router
    handle = router.register_forward_hook(lambda m, args, out: maps.append(out[1].detach()))
    return maps, handle


def _hf_logprobs_forced(model_dir, batch):
    """Float64 transformers, per sequence, its sparse layer's router forced to the batch's
    routing where it has one (its own top k elsewhere); probabilities as Qwen3-MoE's router
    computes them over the chosen experts."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    gate = model.model.layers[1].mlp.gate
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    forced = iter(batch.routed_experts[:, 1].long().split(lengths))

    def forward(hidden):
        hidden = hidden.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden, gate.weight)
        probs = logits.softmax(-1)
        want = next(forced)
        own = probs.topk(gate.top_k, -1).indices
        indices = torch.where((want >= 0).all(-1, keepdim=True), want, own)
        values = probs.gather(1, indices)
        if gate.norm_topk_prob:
            values = values / values.sum(-1, keepdim=True)
        return logits, values, indices

    gate.forward = forward
    with torch.no_grad():
        logits = torch.cat([model(s[None]).logits[0] for s in batch.input_ids.split(lengths)])
    logp = logits.log_softmax(-1).gather(-1, batch.targets[:, None])[:, 0]
    return torch.where(batch.loss_mask, logp, 0.0).float()


def test_replayed_routing_is_the_given_one_and_logprobs_equal_float64(megatron_tp1, moe_dir):
    trainer = _replay_trainer(moe_dir)
    batch = _with_forced_routing(random_packed_batch(trainer.shape.vocab, LENGTHS, seed=3), 7)
    maps, handle = _routing_maps(trainer)
    (replayed,) = trainer.logprobs([batch])
    own = PackedBatch(**{**batch.__dict__, "routed_experts": None})  # an SFT-like batch
    (routed_as_usual,) = trainer.logprobs([own])
    handle.remove()

    known = (batch.routed_experts[:, 1] >= 0).all(-1)
    given = torch.zeros(batch.num_tokens, 4, dtype=torch.bool)
    given[known] = given[known].scatter(1, batch.routed_experts[known, 1].long(), True)
    assert maps[0].sum(-1).eq(2).all()
    assert torch.equal(maps[0][known], given[known])  # the engine's experts
    assert torch.equal(maps[0][~known], maps[1][~known])  # the router's own choice
    assert not torch.equal(maps[0], maps[1])  # the forced routing is not the natural one

    torch.testing.assert_close(replayed, _hf_logprobs_forced(moe_dir, batch), rtol=1e-5, atol=1e-5)
    natural = PackedBatch(
        **{**batch.__dict__, "routed_experts": torch.full_like(batch.routed_experts, -1)}
    )
    torch.testing.assert_close(
        routed_as_usual, _hf_logprobs_forced(moe_dir, natural), rtol=1e-5, atol=1e-5
    )
    assert (replayed - routed_as_usual).abs().max() > 1e-3


def test_recomputation_replays_the_same_routing(megatron_tp1, moe_dir):
    """Two micro batches with different routings: under recompute: full the layers run again
    in backward, and the step's loss and gradients equal those without recomputation."""
    vocab = _replay_trainer(moe_dir).shape.vocab
    batches = [
        _with_forced_routing(random_packed_batch(vocab, LENGTHS, seed=4, rl=True), 8),
        _with_forced_routing(random_packed_batch(vocab, [13, 6], seed=5, rl=True), 9),
    ]
    results = []
    for recompute in ("none", "full"):
        trainer = _replay_trainer(moe_dir, recompute=recompute)
        metrics = trainer.train_step(batches)
        grads = {
            n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None
        }
        results.append((metrics, grads))
    (plain, plain_grads), (full, full_grads) = results
    assert full["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert full["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    assert full_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(full_grads[name], grad, rtol=1e-5, atol=1e-7)
