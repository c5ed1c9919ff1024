"""Which trainer ranks a weight sync needs (`ranks_gathering_for`): rank 0's tensor-parallel,
pipeline and expert-parallel groups, closed under theirs. Under each layout, with only those
ranks gathering and the stages' parts sent to rank 0 alone (`root_only`), rank 0 holds the
whole model exactly as one process does and the other ranks nothing; a data-parallel replica
outside them skips the gather (a rank wrongly left out would leave rank 0's collective
waiting: the pool fails the call). Rank 0's tensor-parallel and expert-parallel peers send
their parts and never build a whole sharded tensor or another rank's experts."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state

from mtprun.compiler import compile_recipe
from mtprun.models import ep_layout, tp_layout
from mtprun.runner.trainer.parallel import ranks_gathering_for
from mtprun.runner.trainer.trainer import Trainer

from .conftest import make_recipe
from .gloo_pool import gloo_pool
from .qwen3_folders import build_qwen3_moe_folder

# Megatron-core orders ranks tensor-parallel fastest, then data-parallel, then pipeline; with
# whole experts on a rank (expert tensor-parallel size 1) the expert-parallel group is ep
# consecutive ranks: under tp = 2 the tensor-parallel pair itself.
# (dp = 2 alone: test_sft_data_parallel's group, its sync payload and saved folder checked.)
LAYOUTS = {
    "pp2dp2": ({"pp": 2, "dp": 2}, [0, 2]),
    "tp2pp2": ({"tp": 2, "pp": 2}, [0, 1, 2, 3]),
    "dp4ep2": ({"dp": 4, "ep": 2}, [0, 1]),
    "tp2dp2ep2": ({"tp": 2, "dp": 2, "ep": 2}, [0, 1]),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    return build_qwen3_moe_folder(tokenizer, tmp_path_factory.mktemp("qwen3_moe"), seed=1)


def _whole_model_job(rank: int, layout: dict[str, int], model_dir):
    recipe = make_recipe(model_dir, parallel=layout)
    trainer = Trainer(recipe, model_dir, compile_recipe(recipe), "cpu")
    needed = ranks_gathering_for(0)
    if rank not in needed:
        return sorted(needed), None, None
    weights = trainer.hf_state_dict(root_only=True)
    return sorted(needed), weights, _held_whole(trainer)


def _held_whole(trainer: Trainer) -> tuple[int, int]:
    """(whole sharded tensors, whole experts tensors) this rank's root-only TP and EP
    gathers leave it holding."""
    local = {n: t for n, t in trainer.model.state_dict().items() if not n.endswith("_extra_state")}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    full = tp_layout.gather_state_dict(local, tp, tp_group, root_only=True)
    sharded = sum(tp > 1 and tp_layout.split_of(n) != "replicated" for n in full)
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep > 1:
        group = parallel_state.get_expert_model_parallel_group()
        full = ep_layout.gather_state_dict(local, ep, group, root_only=True)
    experts = sum(ep > 1 and ep_layout.is_expert(n) for n in full)
    return sharded, experts


@pytest.mark.parametrize("name", LAYOUTS)
def test_only_the_ranks_of_rank_zeros_gathers_gather(megatron_tp1, moe_dir, name):
    layout, expected = LAYOUTS[name]
    results = gloo_pool().run(layout, _whole_model_job, moe_dir)
    assert [needed for needed, _, _ in results] == [expected] * len(results)
    recipe = make_recipe(moe_dir)
    one = Trainer(recipe, moe_dir, compile_recipe(recipe), "cpu").hf_state_dict()
    weights = results[0][1]
    assert [w for _, w, _ in results[1:]] == [
        {} if r in expected else None for r in range(1, len(results))
    ]
    # Rank 0's TP peers (odd ranks under tp = 2) hold no whole sharded tensor, its EP peers
    # no experts; rank 0 and its pipeline peers, the first ranks of theirs, hold both.
    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    for rank in expected:
        sharded, experts = results[rank][2]
        assert (sharded > 0) == (tp > 1 and rank % tp == 0), (rank, sharded)
        assert (experts > 0) == (ep > 1 and rank % ep == 0), (rank, experts)
    assert weights.keys() == one.keys()
    for key, tensor in one.items():
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=0, msg=key)
