"""Megatron-core's built-in MTP loss stays off: it would train the policy trunk.

Each case re-enables it the way an upstream change could (the config's mtp_num_layers, or
GPTModel building its own MultiTokenPredictionBlock) and expects the model build to refuse.
"""

from __future__ import annotations

import pytest
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)

from mtprun.models import ModelShape
from mtprun.runner.trainer import model as megatron_model
from mtprun.runner.trainer.model import PolicyModel

_transformer_config = megatron_model.transformer_config


def _with_native_mtp(dims: ModelShape, *args):
    config = _transformer_config(dims, *args)
    config.mtp_num_layers = 1  # set, not replaced: replace() would re-run the config's checks
    return config


def test_policy_model_builds_without_megatron_mtp(megatron_tp1, tiny_mimo_dir):
    model = PolicyModel(ModelShape.from_model_dir(tiny_mimo_dir))
    assert model.config.mtp_num_layers is None
    assert len(model.mtp_layers) == 1


def test_mtp_num_layers_in_the_config_is_refused(megatron_tp1, tiny_mimo_dir, monkeypatch):
    monkeypatch.setattr(megatron_model, "transformer_config", _with_native_mtp)
    with pytest.raises(RuntimeError, match=r"built-in MTP loss is enabled.*mtp_num_layers=1"):
        PolicyModel(ModelShape.from_model_dir(tiny_mimo_dir))


def test_a_megatron_mtp_block_is_refused(megatron_tp1, tiny_mimo_dir, monkeypatch):
    monkeypatch.setattr(megatron_model, "transformer_config", _with_native_mtp)
    original_init = GPTModel.__init__

    def init_with_mtp_block(self, config, *args, **kwargs):
        # What an upstream GPTModel that builds MTP from the config alone would do.
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        kwargs["mtp_block_spec"] = get_gpt_mtp_block_spec(
            config, layer_spec, use_transformer_engine=False
        )
        original_init(self, config, *args, **kwargs)

    monkeypatch.setattr(GPTModel, "__init__", init_with_mtp_block)
    with pytest.raises(RuntimeError, match="MultiTokenPredictionBlock is built"):
        PolicyModel(ModelShape.from_model_dir(tiny_mimo_dir))
