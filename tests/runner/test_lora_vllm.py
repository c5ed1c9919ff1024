"""vLLM serves mtprun's PEFT adapter folder (`save_peft_adapter`, what checkpoints and `mtprun
export` write): a generate with a `LoRARequest` on the tiny base model gives peft's greedy
tokens and log-probs. Its own module: the engine needs a process without Megatron's groups."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtprun.models import ModelShape
from mtprun.models.lora import init_adapters, peft_name
from mtprun.runner.policy_folder import save_peft_adapter
from mtprun.runner.rollout.engine import configure_vllm_env, served_dtype
from mtprun.spec.model import LoRASection

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


def _random_adapters(shape, lora, seed):
    """PEFT-named adapters with B drawn too (fresh ones have B = 0: the base's outputs)."""
    g = torch.Generator().manual_seed(seed)
    fresh = init_adapters(shape, lora.layers, lora.rank, range(shape.layers), seed)
    return {peft_name(n): torch.randn(t.shape, generator=g) * 0.2 for n, t in fresh.items()}


def _peft_greedy(model, prompt, eos):
    """Greedy decoding by full forwards: (token ids, log-prob of each)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            step = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
            token = int(step.argmax())
            ids.append(token)
            logprobs.append(float(step[token]))
            if token == eos:
                break
    return ids[len(prompt) :], logprobs


def test_vllm_serves_the_adapter_folder_as_peft_does(tiny_qwen2_dir, tokenizer, tmp_path):
    from peft import PeftModel

    lora = LoRASection(rank=8, alpha=24, targets=["all"])
    shape = ModelShape.from_model_dir(tiny_qwen2_dir)
    folder = save_peft_adapter(
        _random_adapters(shape, lora, seed=3), lora, str(tiny_qwen2_dir), tmp_path / "adapter"
    )
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello").input_ids]
    eos = tokenizer.eos_token_id
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, folder).eval()
    want = [_peft_greedy(peft, p, eos) for p in prompts]
    with peft.disable_adapter():
        plain = [_peft_greedy(peft, p, eos) for p in prompts]
    assert [w[0] for w in want] != [p[0] for p in plain]  # the adapter matters

    configure_vllm_env(tmp_path / "engine")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=str(tiny_qwen2_dir),
        dtype=served_dtype(tiny_qwen2_dir),
        enforce_eager=True,
        enable_lora=True,
        max_lora_rank=lora.rank,
        max_loras=1,
        max_model_len=128,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    try:
        served = llm.generate(requests, params, lora_request=LoRARequest("run", 1, str(folder)))
    finally:
        llm.llm_engine.engine_core.shutdown()
    for completion, (tokens, logprobs) in zip(served, want, strict=True):
        out = completion.outputs[0]
        assert list(out.token_ids) == tokens
        got = [step[token].logprob for step, token in zip(out.logprobs, tokens, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-4)
