"""Data-parallel balancing leaves the step unchanged: the token-weighted loss and the gradient
do not depend on which replica a sequence lands on, nor on how it is packed.

One process emulates each data-parallel replica in turn: it trains only the replica's micro
batches, with the step's global token counts (what `_sum_over_data_parallel` all-reduces
across replicas). Under SGD without clipping a step moves the weights by -lr x gradient, so
the replicas' moves add up to the data-parallel step's (their gradients are summed); the
replicas' losses add up likewise (each is weighted by its share of the step's tokens)."""

from __future__ import annotations

import copy

import pytest
import torch

from mtprun.compiler import compile_recipe
from mtprun.data.balance import rebalance
from mtprun.runner.trainer.micro_batches import trained_sequences
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe, random_packed_batch

SGD = {"optimizer": "sgd", "lr": 1.0, "grad_clip": None}
LOSSES = [{"kind": "grpo", "kl_coef": 0.1}]
LENGTHS = [[9, 14, 6], [20, 4], [3, 17, 8, 5], [31], [2, 11]]


def _emulated_step(trainer, start, micro_batches, replica_of, dp):
    """The loss and the weights' move of one data-parallel step, one replica at a time."""
    step_counts = [
        sum(mb.num_tokens for mb in micro_batches),
        sum(int(mb.loss_mask.sum()) for mb in micro_batches),
        sum(trained_sequences(mb) for mb in micro_batches),
    ]
    loss, move = 0.0, None
    for d in range(dp):
        trainer.load_state_dict(copy.deepcopy(start))
        before = trainer.hf_state_dict()
        calls = []

        def summed(values, with_context=False, calls=calls):
            calls.append(values)
            return step_counts if len(calls) == 1 else values

        trainer._sum_over_data_parallel = summed
        mine = [mb for mb, r in zip(micro_batches, replica_of, strict=True) if r == d]
        loss += trainer.train_step(mine)["loss"]
        after = trainer.hf_state_dict()
        delta = {name: before[name] - after[name] for name in before}
        move = delta if move is None else {n: move[n] + delta[n] for n in move}
    del trainer._sum_over_data_parallel
    return loss, move


def test_the_step_does_not_depend_on_where_a_sequence_trains(megatron_tp1, tiny_qwen2_dir):
    recipe = make_recipe(tiny_qwen2_dir, rl=True, losses=LOSSES, trainer=SGD)
    trainer = Trainer(recipe, tiny_qwen2_dir, compile_recipe(recipe), "cpu")
    start = copy.deepcopy(trainer.state_dict())
    vocab = trainer.shape.vocab
    batches = [random_packed_batch(vocab, n, seed=20 + i, rl=True) for i, n in enumerate(LENGTHS)]

    # One process on the micro batches as packed: the step every layout must equal.
    before = trainer.hf_state_dict()
    want = trainer.train_step(batches)["loss"]
    after = trainer.hf_state_dict()
    want_move = {name: before[name] - after[name] for name in before}

    balanced, layout = rebalance(batches, 2, 40, 64.0)
    assert len(balanced) != len(batches) or any(
        a.num_tokens != b.num_tokens for a, b in zip(balanced, batches, strict=True)
    )  # the sequences moved
    swapped = [1 - r for r in layout.replica_of]
    three, layout3 = rebalance(batches, 3, 32, 0.0)
    cases = [
        ("round-robin", batches, [i % 2 for i in range(len(batches))], 2),
        ("balanced", balanced, layout.replica_of, 2),
        ("balanced, replicas swapped", balanced, swapped, 2),
        ("balanced over 3, smaller budget", three, layout3.replica_of, 3),
    ]
    for name, micro_batches, replica_of, dp in cases:
        loss, move = _emulated_step(trainer, start, micro_batches, replica_of, dp)
        assert loss == pytest.approx(want, rel=1e-5, abs=1e-6), name
        for param, tensor in want_move.items():
            torch.testing.assert_close(move[param], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_the_grpo_step_balances_only_several_replicas(tiny_qwen2_dir):
    from mtprun.runner.run.steps import balance_step

    batches = [random_packed_batch(64, n, seed=i, rl=True) for i, n in enumerate(LENGTHS)]
    tokens = sum(b.num_tokens for b in batches)
    one = make_recipe(tiny_qwen2_dir, rl=True, trainer={"micro_batch_tokens": 40})
    assert balance_step(batches, one, 1) == (batches, None, {})

    two = make_recipe(tiny_qwen2_dir, rl=True, trainer={"micro_batch_tokens": 40})
    balanced, replica_of, metrics = balance_step(batches, two, 2)
    assert sum(b.num_tokens for b in balanced) == tokens
    assert all(b.num_tokens <= 40 for b in balanced)
    assert replica_of.count(0) == replica_of.count(1)
    assert 1.0 <= metrics["train/dp_cost_imbalance"] < 1.2

    off = make_recipe(tiny_qwen2_dir, rl=True, trainer={"micro_batch_tokens": 40, "balance": False})
    same, none, metrics = balance_step(batches, off, 2)
    assert same is batches and none is None and metrics["train/dp_cost_imbalance"] >= 1.0


class _Actor:
    """Stands in for a trainer rank's Ray actor: `train_step.remote` hands back its input."""

    def __init__(self) -> None:
        self.train_step = self

    def remote(self, micro_batches):
        return micro_batches


def _group(dp: int, ranks_per_replica: int = 1):
    import threading

    from mtprun.runner.trainer.group import TrainerGroup

    group = object.__new__(TrainerGroup)
    group.actors = [_Actor() for _ in range(dp * ranks_per_replica)]
    group.lock = threading.RLock()
    group.version, group.dp = 0, dp
    group.replica = [r % dp for r in range(len(group.actors))]
    group.received = None

    def gather(refs):
        group.received = refs
        return refs

    group._gather = gather
    return group


def test_the_group_hands_each_replica_its_micro_batches():
    group = _group(2, ranks_per_replica=2)
    group.train_step(list("abcde"))  # round-robin by default
    assert group.received == [["a", "c", "e"], ["b", "d"], ["a", "c", "e"], ["b", "d"]]
    group.train_step(list("abcd"), [0, 0, 0, 1])
    assert group.received == [["a", "b", "c"], ["d"], ["a", "b", "c"], ["d"]]
    with pytest.raises(ValueError, match="3 micro batches for 2 data-parallel replicas"):
        group.train_step(list("abc"), [1, 1, 1])
    with pytest.raises(ValueError, match="2 replicas for 3 micro batches"):
        group.train_step(list("abc"), [0, 1])
