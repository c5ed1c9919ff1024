"""The vLLM rollout engine against transformers greedy decoding, before and after a weight
sync, with and without MTP speculative decoding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtprun.models.tiny import build_tiny_model
from mtprun.runner.rollout.engine import RolloutEngine, served_dtype, spec_decode_metrics
from mtprun.spec.model import TinyModel
from mtprun.spec.rollout import RolloutSection

from .conftest import TINY

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


def _hf_greedy(model_dir, prompt, eos, max_tokens=MAX_TOKENS):
    """Greedy decoding by full forwards: (token ids, log-prob of each)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            step = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
            token = int(step.argmax())
            ids.append(token)
            logprobs.append(float(step[token]))
            if token == eos:
                break
    return ids[len(prompt) :], logprobs


def _assert_matches_hf(samples, model_dir, prompts, eos):
    for prompt, prompt_samples in zip(prompts, samples, strict=True):
        tokens, logprobs = _hf_greedy(model_dir, prompt, eos)
        for sample in prompt_samples:
            assert sample.token_ids == tokens
            assert sample.logprobs == pytest.approx(logprobs, abs=1e-4)
            stopped = tokens[-1] == eos
            assert sample.finish_reason == ("stop" if stopped else "length")


def _retrained(tokenizer, tmp_path, architecture, mtp_layers=0):
    """'New weights': the same architecture drawn with another seed."""
    spec = TinyModel(architecture=architecture, mtp_layers=mtp_layers, **TINY)
    return build_tiny_model(spec, tokenizer, tmp_path / "new", seed=1)


@pytest.fixture
def prompts(tokenizer):
    return [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]


def test_weight_sync_moves_greedy_outputs_to_the_new_weights(
    tiny_qwen2_dir, tokenizer, prompts, tmp_path
):
    greedy = RolloutSection(temperature=0.0, max_tokens=MAX_TOKENS)
    engine = RolloutEngine(tiny_qwen2_dir, greedy, seed=0, work_dir=tmp_path)
    try:
        before = engine.generate(prompts, n=2)
        _assert_matches_hf(before, tiny_qwen2_dir, prompts, tokenizer.eos_token_id)

        new_dir = _retrained(tokenizer, tmp_path, "qwen2")
        seconds = engine.update_weights(load_file(new_dir / "model.safetensors").items(), version=1)
        after = engine.generate(prompts, n=1)
        counters = engine.spec_decode_counters()
        # Back to the first weights in parts (a colocated sync's way), after an update given
        # up part way, which leaves the engine refusing to generate.
        parts = _layer_parts(load_file(tiny_qwen2_dir / "model.safetensors"))
        engine.begin_update(version=2)
        engine.load_part(parts[0])
        engine.abort_update()
        with pytest.raises(RuntimeError, match="did not complete"):
            engine.generate(prompts, n=1)
        engine.begin_update(version=3)
        with pytest.raises(RuntimeError, match="under way"):
            engine.begin_update(version=3)
        for part in parts:
            engine.load_part(part)
        parted_seconds = engine.finish_update()
        again = engine.generate(prompts, n=2)
    finally:
        engine.shutdown()
    assert seconds > 0 and parted_seconds > 0
    assert counters == {}
    assert [s[0].token_ids for s in after] != [s[0].token_ids for s in before]
    _assert_matches_hf(after, new_dir, prompts, tokenizer.eos_token_id)
    _assert_matches_hf(again, tiny_qwen2_dir, prompts, tokenizer.eos_token_id)
    assert {s.version for samples in again for s in samples} == {3}
    with pytest.raises(ValueError, match="at least one sample"):
        engine.generate(prompts, n=0)


def _layer_parts(weights: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors as a sync's parts: those outside the layers, then one part per layer."""
    parts: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        parts.setdefault(layer, []).append((name, tensor))
    return [parts[key] for key in sorted(parts, key=lambda k: int(k) if k else -1)]


def test_engine_refuses_a_process_with_a_distributed_group(tiny_qwen2_dir, tmp_path):
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="own process"):
            RolloutEngine(tiny_qwen2_dir, RolloutSection(), seed=0, work_dir=tmp_path)
    finally:
        torch.distributed.destroy_process_group()


def _drafter_input_proj(worker):
    drafter = worker.model_runner.drafter.model.model
    return next(iter(drafter.mtp_layers.values())).input_proj.weight.detach().clone()


def test_mtp_speculative_decoding_is_lossless_and_syncs_the_drafter(
    tiny_mimo_dir, tokenizer, prompts, tmp_path
):
    speculative = RolloutSection(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        speculative={"method": "mtp", "num_speculative_tokens": 1},
    )
    engine = RolloutEngine(tiny_mimo_dir, speculative, seed=0, work_dir=tmp_path)
    try:
        _assert_matches_hf(
            engine.generate(prompts, n=1), tiny_mimo_dir, prompts, tokenizer.eos_token_id
        )
        counters = engine.spec_decode_counters()
        assert counters["num_drafts"] > 0
        assert counters["num_draft_tokens"] >= counters["num_accepted_tokens"]
        assert "num_accepted_tokens_per_pos/0" in counters

        new_dir = _retrained(tokenizer, tmp_path, "mimo", mtp_layers=1)
        new = load_file(new_dir / "model.safetensors")
        engine.update_weights(new.items(), version=1)
        (drafter_weight,) = engine.llm.collective_rpc(_drafter_input_proj)
        after = engine.generate(prompts, n=1)
        later = engine.spec_decode_counters()
    finally:
        engine.shutdown()
    torch.testing.assert_close(drafter_weight, new["model.mtp_layers.0.input_proj.weight"])
    _assert_matches_hf(after, new_dir, prompts, tokenizer.eos_token_id)
    assert later["num_drafts"] > counters["num_drafts"]
    step = spec_decode_metrics({k: v - counters.get(k, 0.0) for k, v in later.items()})
    # One draft token per step: a draft's acceptance is its first position's.
    assert step["rollout/spec_drafts"] == later["num_drafts"] - counters["num_drafts"]
    assert step["rollout/spec_accept_rate/pos0"] == step["rollout/spec_accept_rate"]
    assert step["rollout/spec_mean_accepted_len"] == 1.0 + step["rollout/spec_accept_rate"]


def test_spec_decode_metrics_from_counter_differences():
    delta = {
        "num_drafts": 10.0,
        "num_draft_tokens": 20.0,
        "num_accepted_tokens": 12.0,
        "num_accepted_tokens_per_pos/0": 8.0,
        "num_accepted_tokens_per_pos/1": 4.0,
    }
    assert spec_decode_metrics(delta) == {
        "rollout/spec_accept_rate": 0.6,
        "rollout/spec_mean_accepted_len": 2.2,
        "rollout/spec_drafts": 10.0,
        "rollout/spec_accept_rate/pos0": 0.8,
        "rollout/spec_accept_rate/pos1": 0.4,
    }
    assert spec_decode_metrics({"num_drafts": 0.0, "num_draft_tokens": 0.0}) == {}


def test_engine_samples_in_the_trainers_dtype(tmp_path):
    """model.dtype is the trainer's and the rollouts' dtype: a folder whose config.json says
    float32 is served in bfloat16 when the trainer trains in it (sampling in float32 beside a
    bfloat16 trainer ran a 1.7B GPU rollout 2.7x slower, with mismatched log-probs)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], "torch_dtype": "float32"})
    )
    assert served_dtype(folder, "bfloat16") == "bfloat16"
    assert served_dtype(folder, "float32") == "float32"
    assert served_dtype(folder) == "float32"  # no trainer: the folder's own
