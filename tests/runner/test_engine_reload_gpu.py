"""A vLLM CUDA engine reloads every parameter from weights streamed as a weight transfer's
buckets arrive (a generator, consumed once: `TransferGroup.receive`), bit for bit: new
weights change every matrix, the folder's own bring back what the engine started with. CUDA
only (marked gpu); the CPU build's reload of a stream is test_rollout's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

if not torch.cuda.is_available():
    pytest.skip("a vLLM CUDA engine needs a GPU", allow_module_level=True)

from mtprun.runner.rollout.engine import RolloutEngine
from mtprun.spec.rollout import RolloutSection

from .gpu_folders import gpu_folder

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _stream(folder: Path):
    return iter(load_file(folder / "model.safetensors").items())


def _engine_parameters(engine: RolloutEngine) -> dict[str, torch.Tensor]:
    def read(worker):
        model = worker.model_runner.model
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}

    return engine.llm.collective_rpc(read)[0]


def test_an_engine_reloads_every_parameter_from_a_stream(tokenizer, tmp_path):
    start_dir = gpu_folder(tmp_path / "start", tokenizer, "qwen3", seed=0)
    new_dir = gpu_folder(tmp_path / "new", tokenizer, "qwen3", seed=1)
    greedy = RolloutSection(temperature=0.0, max_tokens=8)
    engine = RolloutEngine(start_dir, greedy, seed=0, work_dir=tmp_path / "engine")
    try:
        started = _engine_parameters(engine)
        engine.update_weights(_stream(new_dir), version=1)
        new = _engine_parameters(engine)
        engine.update_weights(_stream(start_dir), version=2)
        back = _engine_parameters(engine)
    finally:
        engine.shutdown()
    # Every matrix is drawn anew (norm weights may be equal in both folders).
    unchanged = [n for n, p in started.items() if p.dim() > 1 and torch.equal(new[n], p)]
    assert not unchanged
    for name, parameter in started.items():
        assert torch.equal(back[name], parameter), name
