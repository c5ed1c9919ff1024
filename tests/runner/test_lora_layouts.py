"""LoRA under every parallel layout equals one process: started from a PEFT adapter folder
(`model.lora.path`, B nonzero so every adapter matters from the first step), each layout's
shards of it are loaded (tp: B or A split like the base; pp: each stage its layers), and three
AdamW steps give the same losses, gradient norms, log-probs and gathered adapters. Expert
parallelism: attention adapters on a Qwen3-MoE policy (its experts take none) under dp2 ep2.
Fresh adapters (B = 0) under tp=2 on Qwen2 and Qwen3: each rank its share of the adapters,
and the same steps and merged weights as one process.

Every layout has two processes: the shared kept workers (`gloo_pool`) train them all in turn
(`lora_layout_ranks`), so the processes' start (torch and Megatron imports) is paid once."""

from __future__ import annotations

import pytest
import torch

from mtprun.models import ModelShape
from mtprun.models.lora import init_adapters, peft_name
from mtprun.preflight.memory import lora_layer_params
from mtprun.runner.policy_folder import save_peft_adapter
from mtprun.spec.model import LoRASection
from mtprun.spec.parallel import ParallelSection

from . import lora_layout_ranks
from .conftest import make_recipe, random_packed_batch
from .gloo_pool import gloo_pool
from .qwen3_folders import build_qwen3_moe_folder

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 12, "targets": ["all"]}
ATTENTION_LORA = {**LORA, "targets": ["qkv", "proj"]}  # an MoE policy's experts take none
ADAMW = {"optimizer": "adamw", "lr": 1e-2, "grad_clip": 1.0}
FRESH_ADAMW = {"optimizer": "adamw", "lr": 1e-2}  # the default grad clip

FOLDER_LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "dp2": {"dp": 2}}
FRESH_MODELS = ["tiny_qwen2_dir", "tiny_qwen3_dir"]


def _random_adapter_folder(model_dir, lora_fields, folder):
    """A PEFT adapter folder for the model in `model_dir`, A and B drawn at random."""
    shape, lora = ModelShape.from_model_dir(model_dir), LoRASection(**lora_fields)
    g = torch.Generator().manual_seed(11)
    fresh = init_adapters(shape, lora.layers, lora.rank, range(shape.layers), seed=0)
    adapters = {peft_name(n): torch.randn(t.shape, generator=g) * 0.1 for n, t in fresh.items()}
    return save_peft_adapter(adapters, lora, str(model_dir), folder)


def _case(model_dir, lora, trainer, parallel):
    """A layout's (or one process's: parallel {}) recipe on `model_dir` and its two micro
    batches, for `lora_layout_ranks.train`."""
    recipe = make_recipe(
        model_dir, model={"path": str(model_dir), "lora": lora}, parallel=parallel, trainer=trainer
    )
    vocab = ModelShape.from_model_dir(model_dir).vocab
    batches = [random_packed_batch(vocab, [9, 14, 6], 8), random_packed_batch(vocab, [20, 4], 9)]
    return {"model_dir": model_dir, "recipe": recipe, "batches": batches}


@pytest.fixture(scope="module")
def layouts(tiny_qwen2_dir, tiny_qwen3_dir, tokenizer, tmp_path_factory):
    """Every layout's case and what its last rank reported, trained by the shared workers."""
    tmp = tmp_path_factory.mktemp("lora_layouts")
    adapter_dir = _random_adapter_folder(tiny_qwen2_dir, LORA, tmp / "adapter")
    moe_dir = build_qwen3_moe_folder(tokenizer, tmp / "moe", seed=0)
    moe_adapters = _random_adapter_folder(moe_dir, ATTENTION_LORA, tmp / "moe_adapter")
    from_folder = {**LORA, "path": str(adapter_dir)}
    cases = {
        name: _case(tiny_qwen2_dir, from_folder, ADAMW, parallel)
        for name, parallel in FOLDER_LAYOUTS.items()
    }
    moe_lora = {**ATTENTION_LORA, "path": str(moe_adapters)}
    cases["moe_dp2ep2"] = _case(moe_dir, moe_lora, ADAMW, {"dp": 2, "ep": 2})
    folders = {"tiny_qwen2_dir": tiny_qwen2_dir, "tiny_qwen3_dir": tiny_qwen3_dir}
    for fixture in FRESH_MODELS:
        cases[f"fresh_{fixture}"] = _case(folders[fixture], LORA, FRESH_ADAMW, {"tp": 2})
    reports = {}
    for name, case in cases.items():
        layout = case["recipe"].parallel.model_dump()
        # The last rank: the last pipeline stage, where the losses are.
        reports[name] = gloo_pool().run(layout, lora_layout_ranks.rank_job, case)[-1]
    return cases, reports


@pytest.fixture(scope="module")
def one_process(megatron_tp1):
    """One process's report for a case, computed once per (model, adapters, optimizer)."""
    cache = {}

    def report(case):
        recipe = case["recipe"]
        key = (str(case["model_dir"]), repr(recipe.model.lora), repr(recipe.trainer))
        if key not in cache:
            one = recipe.model_copy(update={"parallel": ParallelSection()})
            cache[key] = lora_layout_ranks.train({**case, "recipe": one}, [0, 1])
        return cache[key]

    return report


def _assert_same_training(one, two):
    """Three steps' losses and gradient norms within 1e-4 of one process."""
    assert one["metrics"][-1]["loss"] < one["metrics"][0]["loss"]
    for step1, step2 in zip(one["metrics"], two["metrics"], strict=True):
        for name in ("loss", "grad_norm", "trained_tokens"):
            assert step2[name] == pytest.approx(step1[name], rel=1e-4), name


def _assert_trains_like_one_process(one, two):
    _assert_same_training(one, two)
    torch.testing.assert_close(two["logprobs"], one["logprobs"], rtol=1e-5, atol=1e-5)
    assert two["adapters"].keys() == one["adapters"].keys()
    for name, tensor in one["adapters"].items():
        torch.testing.assert_close(two["adapters"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", list(FOLDER_LAYOUTS))
def test_lora_layouts_train_like_one_process(layouts, one_process, name):
    cases, reports = layouts
    _assert_trains_like_one_process(one_process(cases[name]), reports[name])


def test_attention_lora_on_an_moe_policy_under_expert_parallelism(layouts, one_process):
    cases, reports = layouts
    _assert_trains_like_one_process(one_process(cases["moe_dp2ep2"]), reports["moe_dp2ep2"])


@pytest.mark.parametrize("fixture", FRESH_MODELS)
def test_lora_tp2_trains_like_one_process(layouts, one_process, fixture):
    """Fresh adapters under tp=2: each rank holds its share of them (the plan's count), the
    steps are one process's, and the merged weights (gathered over tp) are the same model."""
    cases, reports = layouts
    case, two = cases[f"fresh_{fixture}"], reports[f"fresh_{fixture}"]
    one = one_process(case)
    shape = ModelShape.from_model_dir(case["model_dir"])
    assert two["count"] == shape.layers * lora_layer_params(shape, 2, LoRASection(**LORA))
    _assert_same_training(one, two)
    assert two["merged"].keys() == one["merged"].keys()
    for name, tensor in one["merged"].items():
        torch.testing.assert_close(two["merged"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
