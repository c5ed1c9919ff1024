"""LoRA persistence: a checkpoint's PEFT adapter folder (peft loads it and scores as the
trainer does), `mtprun export` (the adapter folder by default, `--merge` the merged HF folder:
W + alpha / r B A against float64), resuming the adapters with their optimizer state, and
`model.lora.path` starting from an adapter folder (float32 on CPU). A LoRA `mtprun run`'s
checkpoints and final export: test_lora_rollout.py (its end-to-end GRPO run)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtprun.cli import main
from mtprun.compiler import compile_recipe
from mtprun.models.lora import is_adapter
from mtprun.runner.run import checkpoint
from mtprun.runner.run.export import export_checkpoint
from mtprun.runner.run.stages import plan_stages
from mtprun.runner.run_dir import RunDir
from mtprun.runner.trainer.trainer import Trainer
from mtprun.runner.trainer.worker import TrainerWorker

from .conftest import make_recipe, random_packed_batch
from .test_lora import _packed_logprobs

LORA = {"rank": 4, "alpha": 12, "targets": ["qkv", "proj", "fc2"]}
MODULES = ["down_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
ADAMW = {"optimizer": "adamw", "lr": 1e-2, "grad_clip": None}


def _recipe(model_dir, lora=LORA):
    return make_recipe(model_dir, model={"path": str(model_dir), "lora": lora}, trainer=ADAMW)


def _worker(recipe, model_dir):
    """A trainer rank as the run's actors hold it (in this process, Megatron initialised)."""
    worker = TrainerWorker(rank=0, world_size=1, torch_threads=None)
    worker.build(recipe, str(model_dir), compile_recipe(recipe).to_json(), with_reference=False)
    return worker


def _batches(vocab):
    return [random_packed_batch(vocab, [9, 14], 4), random_packed_batch(vocab, [20], 5)]


@pytest.fixture(scope="module")
def lora_run(megatron_tp1, tiny_qwen3_dir, tmp_path_factory):
    """Two AdamW steps of LoRA on the tiny Qwen3 model, checkpointed as the driver does; then
    two more steps (the continuation a resume must reproduce)."""
    worker = _worker(_recipe(tiny_qwen3_dir), tiny_qwen3_dir)
    batches = _batches(worker.trainer.shape.vocab)
    for _ in range(2):
        worker.train_step(batches)
    root = tmp_path_factory.mktemp("lora_run") / "checkpoints"
    folder = checkpoint.write(root, 2, worker.save, {"step": 2})
    logprobs = worker.logprobs(batches)
    continued = [worker.train_step(batches) for _ in range(2)]
    return {"root": root, "folder": folder, "batches": batches, "logprobs": logprobs,
            "continued": continued}  # fmt: skip


def test_checkpoint_holds_a_peft_adapter_folder_that_peft_scores_like_the_trainer(
    lora_run, tiny_qwen3_dir
):
    from peft import PeftModel

    adapter = lora_run["folder"] / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 12, 0.0)
    assert config["target_modules"] == MODULES
    assert config["base_model_name_or_path"] == str(tiny_qwen3_dir.resolve())
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * len(MODULES)  # 2 layers, A and B of each module
    assert all(t.abs().sum() > 0 for t in tensors.values())  # B moved off zero

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        for batch, got in zip(lora_run["batches"], lora_run["logprobs"], strict=True):
            torch.testing.assert_close(got, _packed_logprobs(peft, batch), rtol=1e-5, atol=1e-5)


def test_export_writes_the_adapter_folder_and_merge_the_merged_weights(
    lora_run, tiny_qwen3_dir, tmp_path
):
    out = export_checkpoint(lora_run["root"], None, tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    merged = export_checkpoint(lora_run["root"], 2, tmp_path / "merged", merged=True)
    # W + alpha / r B A, in float64 from the base model and the adapter folder.
    base = load_file(tiny_qwen3_dir / "model.safetensors")
    adapters = load_file(out / "adapter_model.safetensors")
    got = load_file(merged / "model.safetensors")
    assert got.keys() == base.keys()
    adapted = 0
    for name, weight in base.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        want = weight.double()
        if prefix + ".lora_A.weight" in adapters:
            a, b = (adapters[f"{prefix}.lora_{m}.weight"].double() for m in "AB")
            want = want + 12 / 4 * b @ a
            adapted += 1
        torch.testing.assert_close(got[name].double(), want, rtol=1e-6, atol=1e-6, msg=name)
    assert adapted == 2 * len(MODULES)
    # transformers scores the merged folder as the trainer does.
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        want = _packed_logprobs(model, lora_run["batches"][0])
    torch.testing.assert_close(lora_run["logprobs"][0], want, rtol=1e-5, atol=1e-5)


def test_mtprun_export_merge(lora_run, tmp_path, capsys):
    run = RunDir(tmp_path / "run").create()
    run.write_state({"tracking_uri": "sqlite:///x.db", "run_id": "r"})
    run.checkpoints.rmdir()
    run.checkpoints.symlink_to(lora_run["root"])
    assert main(["export", str(run.root)]) == 0
    assert (run.exports / "step_2" / "adapter_config.json").is_file()
    assert main(["export", str(run.root), "--merge", "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    # A full fine-tune's checkpoint has nothing to merge.
    full = tmp_path / "full"
    partial = checkpoint.begin(full, 1)
    (partial / "hf").mkdir()
    checkpoint.publish(partial, {"step": 1})
    capsys.readouterr()
    with pytest.raises(ValueError, match="trained every weight"):
        export_checkpoint(full, None, tmp_path / "x", merged=True)
    run.checkpoints.unlink()
    run.checkpoints.symlink_to(full)
    assert main(["export", str(run.root), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "trained every weight (no model.lora)" in err and "leave out --merge" in err


def test_resume_continues_the_adapters_and_their_optimizer_state(lora_run, tiny_qwen3_dir):
    saved = torch.load(lora_run["folder"] / "trainer_rank0.pt", weights_only=False)
    assert saved["model"] and all(is_adapter(n) for n in saved["model"])  # the base is frozen
    resumed = _worker(_recipe(tiny_qwen3_dir), tiny_qwen3_dir)
    assert resumed.load(str(lora_run["folder"])) == 2
    moments = resumed.trainer.groups[0].optimizer.state
    assert moments and all(s["step"] == 2 for s in moments.values())  # AdamW's, restored
    batches = lora_run["batches"]
    assert [resumed.train_step(batches) for _ in range(2)] == lora_run["continued"]


def test_resume_refuses_adapters_of_other_targets(lora_run, tiny_qwen3_dir):
    other = _worker(_recipe(tiny_qwen3_dir, {**LORA, "targets": ["qkv", "proj"]}), tiny_qwen3_dir)
    with pytest.raises(ValueError, match=r"adapters do not fit this recipe's model\.lora"):
        other.load(str(lora_run["folder"]))


def test_lora_path_starts_from_the_adapter_folder(lora_run, tiny_qwen3_dir):
    adapter = lora_run["folder"] / "adapter"
    recipe = _recipe(tiny_qwen3_dir, {**LORA, "path": str(adapter)})
    trainer = Trainer(recipe, tiny_qwen3_dir, compile_recipe(recipe), "cpu")
    saved = load_file(adapter / "adapter_model.safetensors")
    assert trainer.adapter_state_dict().keys() == saved.keys()
    for name, tensor in trainer.adapter_state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    torch.testing.assert_close(trainer.logprobs(lora_run["batches"]), lora_run["logprobs"])
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter(n) for n in trained)


def test_the_trainer_refuses_an_adapter_folder_that_does_not_fit(lora_run, tiny_qwen3_dir):
    adapter = str(lora_run["folder"] / "adapter")
    recipe = _recipe(tiny_qwen3_dir, {**LORA, "rank": 8, "path": adapter})
    with pytest.raises(ValueError, match=r"^model\.lora\.path: .* rank r is 4 but model\.lora"):
        Trainer(recipe, tiny_qwen3_dir, compile_recipe(recipe), "cpu")


def test_the_grpo_stage_after_a_warmstart_starts_fresh_adapters(tiny_qwen3_dir):
    """The warmstart's end folder holds model.lora.path's adapters merged already."""
    lora = {**LORA, "path": "/adapters/a"}
    data = {"source": "arithmetic", "template": "chatml"}
    recipe = make_recipe(
        tiny_qwen3_dir,
        rl=True,
        model={"path": str(tiny_qwen3_dir), "lora": lora},
        warmstart={"data": data, "steps": 2, "lr": 1e-3},
    )
    warmstart, grpo = plan_stages(recipe)
    assert warmstart.recipe.model.lora.path == "/adapters/a"
    assert grpo.recipe.model.lora.path is None
    assert grpo.recipe.model.lora.rank == 4
