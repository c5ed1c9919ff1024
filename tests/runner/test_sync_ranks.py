"""Which trainer ranks a weight sync needs (`ranks_gathering_for`): rank 0's tensor-parallel,
pipeline and expert-parallel groups, closed under theirs. Under each layout, with only those
ranks gathering and the stages' parts sent to rank 0 alone (`root_only`), rank 0 holds the
whole model exactly as one process does and the other ranks nothing; a data-parallel replica
outside them skips the gather (a rank wrongly left out would leave rank 0's collective
waiting: the pool fails the call)."""

from __future__ import annotations

import pytest
import torch

from mtprun.compiler import compile_recipe
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
    weights = trainer.hf_state_dict(root_only=True) if rank in needed else None
    return sorted(needed), weights


@pytest.mark.parametrize("name", LAYOUTS)
def test_only_the_ranks_of_rank_zeros_gathers_gather(megatron_tp1, moe_dir, name):
    layout, expected = LAYOUTS[name]
    results = gloo_pool().run(layout, _whole_model_job, moe_dir)
    assert [needed for needed, _ in results] == [expected] * len(results)
    recipe = make_recipe(moe_dir)
    one = Trainer(recipe, moe_dir, compile_recipe(recipe), "cpu").hf_state_dict()
    weights = results[0][1]
    assert [w for _, w in results[1:]] == [
        {} if r in expected else None for r in range(1, len(results))
    ]
    assert weights.keys() == one.keys()
    for key, tensor in one.items():
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=0, msg=key)
