"""Which trainer ranks a weight sync needs (`ranks_gathering_for`): rank 0's tensor-parallel,
pipeline and expert-parallel groups, closed under theirs. Under each layout, with only those
ranks gathering and the stages' parts sent to rank 0 alone (`root_only`), rank 0 holds the
whole model exactly as one process does and the other ranks nothing; a data-parallel replica
outside them skips the gather (a rank wrongly left out would leave rank 0's collective
waiting: the pool fails the call). Rank 0's tensor-parallel and expert-parallel peers send
their parts and never build a whole sharded tensor or another rank's experts. A sync's
stream of a layer at a time (`hf_state_dict_chunks`) holds the same tensors, rank 0's parts
each a layer's, every other rank's empty; in one process, for every architecture, the parts
hold exactly what the whole conversion does, each converted from its own layers' tensors."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from megatron.core import parallel_state
from safetensors.torch import load_file

from mtprun.compiler import compile_recipe
from mtprun.models import ModelShape, build_tiny_model, ep_layout, tp_layout
from mtprun.models.convert import hf_to_megatron, megatron_to_hf
from mtprun.models.pp_layout import PipelineStage, layer_of
from mtprun.runner.trainer.parallel import ranks_gathering_for
from mtprun.runner.trainer.trainer import Trainer
from mtprun.runner.trainer.whole_model import whole_model_chunks
from mtprun.spec.families import MTP_ARCHITECTURES, TINY_ARCHITECTURES
from mtprun.spec.model import TinyModel

from .conftest import TINY, make_recipe
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
        return sorted(needed), None, None, None
    weights = trainer.hf_state_dict(root_only=True)
    parts = list(trainer.hf_state_dict_chunks(root_only=True, layers=1))
    return sorted(needed), weights, _held_whole(trainer), parts


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
    assert [needed for needed, *_ in results] == [expected] * len(results)
    recipe = make_recipe(moe_dir)
    one = Trainer(recipe, moe_dir, compile_recipe(recipe), "cpu").hf_state_dict()
    weights = results[0][1]
    assert [w for _, w, *_ in results[1:]] == [
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
    # The stream: a part a layer (the whole model in one under pipeline parallelism).
    parts = results[0][3]
    layers = ModelShape.from_model_dir(moe_dir).layers
    assert len(parts) == (1 if layout.get("pp", 1) > 1 else layers)
    if len(parts) == layers:
        assert [_layers_in(part) for part in parts] == [{k} for k in range(layers)]
    streamed = {name: t for part in parts for name, t in part.items()}
    assert streamed.keys() == one.keys() and sum(map(len, parts)) == len(one)
    for key, tensor in one.items():
        torch.testing.assert_close(streamed[key], tensor, rtol=0, atol=0, msg=key)
    for rank in expected[1:]:
        assert all(part == {} for part in results[rank][3]), rank


def _layers_in(part: dict[str, torch.Tensor]) -> set[int]:
    return {int(m[1]) for name in part if (m := re.match(r"model\.layers\.(\d+)\.", name))}


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_a_streamed_model_is_the_whole_model_in_parts(
    megatron_tp1, tokenizer, tmp_path, architecture
):
    mtp = {"mtp_layers": 1} if architecture in MTP_ARCHITECTURES else {}
    spec = TinyModel(architecture=architecture, **{**TINY, "layers": 3}, **mtp)
    folder = build_tiny_model(spec, tokenizer, tmp_path, seed=0)
    shape = ModelShape.from_model_dir(folder)
    local = hf_to_megatron(load_file(folder / "model.safetensors"), shape)
    convert = partial(megatron_to_hf, shape=shape)
    whole = convert(local)
    stage = PipelineStage(0, 1, shape.layers)
    parts = list(whole_model_chunks(local, shape, stage, False, convert, layers=2))
    # GLM-4.5's MTP layer is HF layer 3 (after the decoder's): outside them, in the first.
    assert [_layers_in(part) - {shape.layers} for part in parts] == [{0, 1}, {2}]
    streamed = {name: t for part in parts for name, t in part.items()}
    assert streamed.keys() == whole.keys() and sum(map(len, parts)) == len(whole)
    for name, tensor in whole.items():
        assert torch.equal(streamed[name], tensor), name
    # A part's conversion reads its own tensors alone: given nothing else, it gives the same.
    for part, got in zip((range(0, 2), range(2, 4)), parts, strict=True):
        own = {n: t for n, t in local.items() if _in_part(n, part)}
        assert convert(own, part=part).keys() == got.keys()


def _in_part(name: str, part: range) -> bool:
    layer = layer_of(name)
    return part.start == 0 if layer is None else layer in part
