"""Shared runner fixtures: tiny model folders built once per session, recipes, batches and a
local Ray instance (the session's one vLLM cache is tests/conftest.py's)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mtprun.data.batch import PackedBatch
from mtprun.data.tokenizer import build_tokenizer
from mtprun.models import build_tiny_model
from mtprun.runner.net import free_port
from mtprun.spec.model import TinyModel
from mtprun.spec.recipe import Recipe

# chatml: 102 tokens, padded to a 128-row vocab that TP=2 splits. Head size 32 (vLLM's CPU minimum),
# kv_heads 2 so TP=2 splits the key/value groups too.
TEMPLATE = "chatml"
TINY = {
    "hidden": 64,
    "layers": 2,
    "heads": 2,
    "kv_heads": 2,
    "intermediate": 128,
    "max_seq_len": 256,
}


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(TEMPLATE)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tokenizer) -> Path:
    """A random-init Qwen2 folder (untied output layer)."""
    spec = TinyModel(architecture="qwen2", **TINY)
    return build_tiny_model(spec, tokenizer, tmp_path_factory.mktemp("qwen2"), seed=0)


@pytest.fixture(scope="session")
def tiny_mimo_dir(tmp_path_factory, tokenizer) -> Path:
    """A random-init MiMo folder: Qwen2 trunk plus one MTP layer."""
    spec = TinyModel(architecture="mimo", mtp_layers=1, **TINY)
    return build_tiny_model(spec, tokenizer, tmp_path_factory.mktemp("mimo"), seed=0)


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory, tokenizer) -> Path:
    """A random-init Qwen2 folder whose output layer is the input embedding."""
    spec = TinyModel(architecture="qwen2", tie_embeddings=True, **TINY)
    return build_tiny_model(spec, tokenizer, tmp_path_factory.mktemp("tied"), seed=4)


@pytest.fixture(scope="session")
def tiny_tied_mimo_dir(tmp_path_factory, tokenizer) -> Path:
    """A random-init MiMo folder with one MTP layer whose output layer is the embedding."""
    spec = TinyModel(architecture="mimo", mtp_layers=1, tie_embeddings=True, **TINY)
    return build_tiny_model(spec, tokenizer, tmp_path_factory.mktemp("tied_mimo"), seed=5)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tokenizer) -> Path:
    """A random-init Qwen3 folder (untied): 4 query heads and 2 key/value heads of 32 channels
    on hidden 64 (head_dim apart from hidden / heads), every norm weight drawn around 1 so that
    the q/k norms' gradients differ per channel (`qwen3_folders`)."""
    from .qwen3_folders import build_qwen3_folder  # it imports TINY from here

    return build_qwen3_folder(tokenizer, tmp_path_factory.mktemp("qwen3"), seed=0)


def make_recipe(model_dir: Path, rl: bool = False, **sections: Any) -> Recipe:
    """An SFT recipe (rl: a GRPO recipe on the arithmetic task) on `model_dir`; keyword
    arguments replace whole sections."""
    if rl:
        source = {"task": {"name": "arithmetic", "reward": "arithmetic", "template": TEMPLATE}}
    else:
        source = {"data": {"source": "arithmetic", "template": TEMPLATE}}
    data = {"name": "test", "model": {"path": str(model_dir)}, **source, **sections}
    return Recipe.model_validate(data)


def random_packed_batch(
    vocab: int, lengths: list[int], seed: int, rl: bool = False, masked_frac: float = 0.3
) -> PackedBatch:
    """Sequences of random tokens packed back to back, with a random loss mask (never on the
    last token of a sequence) and, for RL, random advantages and old/ref log-probs."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens = torch.randint(0, vocab, (total,), generator=g)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    targets = torch.roll(tokens, -1)
    loss_mask = torch.rand(total, generator=g) >= masked_frac
    loss_mask[cu_seqlens[1:].long() - 1] = False
    positions = torch.cat([torch.arange(n) for n in lengths])
    extras = {}
    if rl:
        extras = {
            "advantages": torch.randn(total, generator=g),
            "old_logprobs": -torch.rand(total, generator=g) * 5,
            "ref_logprobs": -torch.rand(total, generator=g) * 5,
        }
    return PackedBatch(tokens, targets, loss_mask, positions, cu_seqlens, **extras)


@pytest.fixture(scope="module")
def megatron_tp1():
    """Megatron-core model parallelism of one process (tp=pp=cp=dp=1) in the test process,
    for one test module: a vLLM engine in another module needs the process without it."""
    from mtprun.runner.trainer.parallel import destroy_parallel, init_parallel
    from mtprun.spec.parallel import ParallelSection

    init_parallel(ParallelSection(), 0, 1, "127.0.0.1", free_port())
    yield
    destroy_parallel()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray instance in the test process for one test module (a module's in-process
    `mtprun run` starts its own), its short temp folder removed afterwards."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's sockets need a short path
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp))
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
