"""vLLM's model-class inspection in an mtprun CPU engine's own process (`vllm_registry`): a
class vLLM has not seen is imported and inspected here, not in a subprocess, and the answer
still goes to vLLM's cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the in-process inspection is for CPU engines", allow_module_level=True)

from vllm import envs
from vllm.model_executor.models import registry

from mtprun.runner.rollout.engine import register_vllm_models

# A class of vLLM's own that no test serves, so that neither this process nor the session's
# cache has seen it.
ARCHITECTURE, MODULE = "BloomForCausalLM", "vllm.model_executor.models.bloom"


def test_a_cpu_engine_process_inspects_a_new_model_class_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_run_in_subprocess", registry._run_in_subprocess)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert MODULE not in sys.modules
    register_vllm_models()
    info = registry.ModelRegistry.models[ARCHITECTURE].inspect_model_cls()
    assert info.is_text_generation_model and not info.is_pooling_model
    assert MODULE in sys.modules  # imported here: a subprocess would have left it out
    cached = (
        Path(envs.VLLM_CACHE_ROOT)
        / "modelinfos"
        / f"{MODULE.replace('.', '-')}-{ARCHITECTURE}.json"
    )
    assert json.loads(cached.read_text())["modelinfo"]["is_text_generation_model"] is True
