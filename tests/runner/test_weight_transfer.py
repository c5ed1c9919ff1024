"""Weights over the transfer group: bucketed bytes sent in parts arrive bit for bit as one
stream (two gloo processes), the receiver holding one bucket at a time;
and end to end, trainer rank 0 broadcasting into a real vLLM engine (MTP drafter included)
leaves the engine exactly as the object-store path does, also after the engine is killed and
restarted (it joins a new generation of the group)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from datetime import timedelta

import pytest
import ray
import torch
import torch.distributed as dist

from mtprun.runner.net import free_port
from mtprun.runner.weight_transfer import TransferHost, _wait_done, plan_buckets

from .conftest import make_recipe, random_packed_batch
from .transfer_member import member as receiving_member


class _NeverDone:
    """A collective whose device work never completes (a receiver gone mid-transfer)."""

    def is_completed(self) -> bool:
        return False


def test_a_broadcast_that_never_completes_fails_named():
    with pytest.raises(TimeoutError, match=r"the weight broadcast .* did not complete in 0 s"):
        _wait_done(
            _NeverDone(), "the weight broadcast to the rollout engines", timedelta(seconds=0.01)
        )


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 7, generator=g),
        "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.big": torch.randn(300, generator=g, dtype=torch.float64),  # larger than a bucket
        "d.steps": torch.tensor(7, dtype=torch.int64),
        "e.half": torch.randn(3, 3, generator=g).to(torch.float16).t(),  # not contiguous
    }


def test_plan_buckets_aligns_tensors_and_gives_a_large_one_its_own_bucket():
    layout = [("x", "float32", [3]), ("y", "bfloat16", [2]), ("z", "float64", [100])]
    slots, sizes = plan_buckets(layout, bucket_bytes=64)
    assert [(s.bucket, s.offset) for s in slots] == [(0, 0), (0, 16), (1, 0)]
    assert sizes == [20, 800]


def test_receiver_gets_every_dtype_bit_for_bit(tmp_path):
    port = free_port()
    host = TransferHost("127.0.0.1", port)
    out = tmp_path / "received.pt"
    member = mp.get_context("spawn").Process(target=receiving_member, args=(port, str(out)))
    member.start()
    host.form(generation=1, world_size=2)
    sent = _weights()
    # In two parts, as a sync sends a few layers at a time; the receiver reads one stream.
    names = list(sent)
    parts = [{n: sent[n] for n in names[:2]}, {n: sent[n] for n in names[2:]}]
    assert host.group.send_parts(iter(parts), bucket_bytes=256) == 924 + 10 + 2400 + (16 + 18)
    member.join(timeout=120)
    assert member.exitcode == 0
    saved = torch.load(out)
    # Four buckets, taken one at a time: the receiver never holds the whole payload.
    assert saved["most_buckets_alive"] == 1
    received = saved["tensors"]
    assert list(received) == list(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name], tensor), name


def test_a_member_that_never_joins_fails_the_formation_and_the_next_generation_forms(tmp_path):
    port = free_port()
    host = TransferHost("127.0.0.1", port)
    # Generation 1's member died before joining (as an engine SIGKILLed mid-join does).
    with pytest.raises(dist.DistStoreError, match="timeout"):
        host.form(generation=1, world_size=2, form_timeout=timedelta(seconds=2))
    assert host.group is None
    out = tmp_path / "received.pt"
    member = mp.get_context("spawn").Process(target=receiving_member, args=(port, str(out), 2))
    member.start()
    host.form(generation=2, world_size=2)
    sent = _weights()
    host.group.send(sent)
    member.join(timeout=120)
    assert member.exitcode == 0
    _assert_equal(torch.load(out)["tensors"], sent)


def _engine_weights(pool) -> dict[str, torch.Tensor]:
    """Every parameter vLLM holds in engine 0: the model's and the MTP drafter's."""

    def read(worker):
        runner = worker.model_runner
        found = {f"model.{n}": p.detach().clone() for n, p in runner.model.named_parameters()}
        drafter = runner.drafter.model.named_parameters()
        found.update({f"drafter.{n}": p.detach().clone() for n, p in drafter})
        return found

    actor = pool.actors[0]
    return ray.get(actor.__ray_call__.remote(lambda w: w.engine.llm.collective_rpc(read)[0]))


def _assert_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


@pytest.mark.slow
def test_collective_sync_equals_the_object_store_also_after_an_engine_restart(
    local_ray, tiny_mimo_dir, tokenizer, tmp_path
):
    from mtprun.compiler import compile_recipe
    from mtprun.runner.rollout.pool import RolloutPool
    from mtprun.runner.run.weight_sync import WeightSync
    from mtprun.runner.trainer.group import TrainerGroup

    recipe = make_recipe(
        tiny_mimo_dir,
        rl=True,
        losses=[{"kind": "grpo"}],
        rollout={"temperature": 0.0, "max_tokens": 8, "speculative": {"method": "mtp"}},
        trainer={"lr": 1e-2},
    )
    trainer = TrainerGroup.start(recipe)
    pool = RolloutPool.launch(recipe, tiny_mimo_dir, tmp_path / "engines").ready()
    collective = WeightSync("collective", lambda: trainer, pool)
    object_store = WeightSync("object_store", lambda: trainer, pool)
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    batch = random_packed_batch(len(tokenizer), [20, 12], seed=3, rl=True)
    try:
        trainer.build(recipe, str(tiny_mimo_dir), compile_recipe(recipe).to_json(), False)
        initial = _engine_weights(pool)
        generations = []
        for version in (1, 2):
            if version == 2:  # as the OOM killer would, between two steps
                os.kill(pool.pids[0], signal.SIGKILL)
            trainer.train_step([batch])
            assert collective.push()["time/sync_s"] > 0
            by_broadcast, greedy = _engine_weights(pool), pool.generate(prompts, n=1)
            object_store.push()
            _assert_equal(by_broadcast, _engine_weights(pool))
            assert pool.generate(prompts, n=1) == greedy
            assert {s.version for samples in greedy for s in samples} == {version}
            generations.append(collective._generation)
    finally:
        pool.shutdown()
        trainer.shutdown()
    assert any(not torch.equal(initial[n], by_broadcast[n]) for n in initial)
    assert any(n.startswith("drafter.") for n in initial)
    assert pool.restarts == 1
    assert generations == [1, 2]  # the restarted engine joined a new group
