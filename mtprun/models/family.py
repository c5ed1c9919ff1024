"""What a model family is: the `Family` descriptor of one HF architecture, the contract of a
family folder (`FamilyUnit`), and how vLLM serves a family's export (`VllmServing`).

A family is a folder `mtprun/models/families/<name>/` (registered in `mtprun.spec.families`,
loaded by `mtprun.models.families`). Its `__init__` defines `NAME` and `FAMILIES`, one `Family`
per HF `architectures` entry it reads; that module and every descriptor it imports are free of
torch (`mtprun validate` reads shapes through them), and torch code (tensor mapping, tiny
tensors) sits in the folder's submodules, named here by import path and imported when used.

A `Family` says what it adds to the `ModelShape` (q/k/v biases, per-head q/k norms, MTP layers,
a mixture-of-experts MLP, hybrid layer kinds; the Megatron-core layer-spec options follow from
those, `ModelShape.megatron_layer_options`), which modules map its tensors HF <-> Megatron both
ways (`converters`: every family's tp layout is `mtprun.models.tp_layout`'s, by tensor name; q/k
norms are per head, so replicated), how its MTP layers read their inputs (the trainer builds
them so), the vLLM architecture that serves its export and what that engine needs
(`VllmServing`), its tiny builder's parts, and the `renderers` family of its chat template.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mtprun.models.expert_shape import ExpertShape
from mtprun.models.folder_tensors import MtpTensors
from mtprun.models.qwen3_5_shape import LinearAttentionShape

if TYPE_CHECKING:
    from mtprun.spec.model import TinyModel

# The Qwen2-style decoder trunk (embedding, layers, final norm, output layer): every family's.
DECODER = "mtprun.models.decoder"
MOE = "mtprun.models.moe"  # the mixture-of-experts MLPs (routers, experts, shared expert)

Config = Mapping[str, Any]  # a config.json's fields


class VllmServing:
    """What the rollout engine does for a family's export beyond naming its folder: vLLM serves
    most as they are (these defaults). Methods get the folder's config.json fields."""

    def register(self) -> None:
        """Register model classes with vLLM before an engine starts (default: none)."""

    def hf_overrides(self, config: Config) -> dict[str, Any] | None:
        """config.json values vLLM needs and the folder leaves to a default."""
        return None

    def dtype(self, config: Config, cuda: bool) -> str | None:
        """The dtype to serve in; None: the checkpoint's."""
        return None

    def engine_args(self, config: Config, speculative: bool, cuda: bool) -> dict[str, Any]:
        """vLLM engine arguments the family needs (`speculative`: a drafter runs)."""
        return {}


@dataclass(frozen=True)
class Family:
    """One HF architecture mtprun converts, trains, serves and exports."""

    architecture: str  # the HF `architectures` entry it reads
    vllm_architecture: str  # the vLLM model class that serves its export
    qkv_bias: Callable[[Config], bool]  # whether a config.json's model has them
    # RMSNorm over each query / key head before RoPE, as a config.json declares it.
    qk_norm: Callable[[Config], bool] = lambda config: False
    mtp: bool = False  # MTP layers (`num_nextn_predict_layers`), trained and served as drafter
    # Its MTP layers' input: [embedding, hidden] (DeepSeek-V3, GLM-4.5) or [hidden, embedding]
    # (MiMo).
    mtp_embedding_first: bool = False
    # Its vLLM drafter zeroes the next token's embedding at position 0 (MiMo, DeepSeek-V3,
    # GLM-4.5); Qwen3.5's does not.
    mtp_zero_first_embedding: bool = True
    # Its vLLM drafter reads the trunk's final-normed hidden state (and, chained, its own
    # normed output) rather than the pre-norm one: GLM-4.5 (vLLM's Glm4MoeModel returns the
    # normed state, as megatron-core's MTP block takes it) and Qwen3.5; MiMo's reads pre-norm.
    mtp_normed_hidden: bool = False
    # Checkpoint tensors it leaves out of conversion: (HF name, num_hidden_layers) -> bool;
    # e.g. an MTP layer not trained yet. None: every tensor must convert.
    unconverted: Callable[[str, int], bool] | None = None
    # Its mixture-of-experts MLP as a config.json declares it; None: a dense model.
    experts: Callable[[Config], ExpertShape] | None = None
    converters: tuple[str, ...] = (DECODER,)  # modules with to_megatron / to_hf, in order
    # A hybrid model's token mixer per layer (`mtprun.models.qwen3_5_shape` kinds) and its
    # linear attention sizes; None: every layer is softmax attention.
    layer_types: Callable[[Config], tuple[str, ...]] | None = None
    linear_attention: Callable[[Config], LinearAttentionShape] | None = None
    output_gate: bool = False  # attention output * sigmoid(gate), the gate from q_proj
    zero_centered_norm: bool = False  # RMSNorm weights w applied as (1 + w)
    # Its config.json keeps the text model's fields under `text_config` (a vision-language
    # checkpoint whose text model mtprun trains).
    text_config: bool = False
    mtp_layers_key: str = "num_nextn_predict_layers"  # config.json's MTP layer count
    # The HF names of MTP layer i's own tensors (`mtprun.models.folder_tensors`): a folder
    # that holds none of them (written by transformers) trains without its MTP layers.
    mtp_tensors: MtpTensors | None = None
    # How the rollout engine serves its export beyond `vllm_architecture`.
    vllm: VllmServing = field(default_factory=VllmServing)
    # The `renderers` family of its official chat template (`mtprun.data.templates.family`),
    # and the config.json `model_type` that names it too; None: no renderer.
    renderer: str | None = None
    model_type: str | None = None
    # Its tiny builder (`mtprun.models.tiny`): its `model.tiny.architecture` name (None: none),
    # the transformers config class it draws from, the config fields the family adds at a
    # tiny spec's sizes, the `ModelShape` fields that follow for it (beyond the sizes, the
    # family's flags and `experts`), the "module:function" that draws its MTP layers' own
    # tensors (config, count) -> tensors, and whether its MTP layers' decoder layers are
    # stored as extra decoder layers (DeepSeek-V3 style).
    tiny: str | None = None
    tiny_config: str = "Qwen2Config"
    tiny_fields: Callable[[TinyModel], dict[str, Any]] | None = None
    tiny_shape: Callable[[TinyModel], dict[str, Any]] | None = None
    tiny_mtp_tensors: str | None = None
    mtp_in_decoder_layers: bool = False


@runtime_checkable
class FamilyUnit(Protocol):
    """A family folder's `__init__` (`mtprun.models.families`' extension point)."""

    NAME: str  # its folder's name, as `mtprun.spec.families` registers it
    FAMILIES: tuple[Family, ...]  # one per HF architecture it reads; the first is the tiny's


def always(config: Config) -> bool:
    return True


def attention_bias(config: Config) -> bool:
    """q/k/v biases as `attention_bias` declares them (false when left out)."""
    return bool(config.get("attention_bias", False))


def load(path: str) -> Any:
    """The object a "module:attribute" path names (imported now)."""
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
