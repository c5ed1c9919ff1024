"""A run's tiny random-init model folder, kept in a cache for the next run that asks for it.

The folder is a function of the recipe's `model.tiny`, the chat template, the seed, the code
that builds it and the libraries that write it, so a run builds it once and later runs copy it
(building costs ~7 CPU-seconds, most of it importing transformers' model classes; a copy, a
few milliseconds). The cache key hashes all of those. A folder is built in a scratch directory
of the cache and renamed into place (`mtprun.runner.cache.add_to_cache`). The cache lives in
`tiny/` of mtprun's cache directory; a cache that cannot be written is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import shutil
from pathlib import Path

import mtprun
from mtprun.data.tokenizer import build_tokenizer
from mtprun.runner.cache import add_to_cache, cache_root
from mtprun.spec.model import TinyModel

log = logging.getLogger(__name__)

# The code a tiny folder comes from: the model builders and the tokenizer with its templates.
_BUILDER_SOURCES = ("models", "data/tokenizer.py", "data/templates", "spec/model.py")
_LIBRARIES = ("torch", "transformers", "safetensors", "tokenizers")


def tiny_model_folder(spec: TinyModel, template: str, seed: int, target: Path) -> Path:
    """Write the tiny model folder of (`spec`, `template`, `seed`) to `target`: a copy of the
    cached one, built first if the cache has none."""
    root = cache_root()
    if root is None:
        return _build(spec, template, seed, target)
    entry = root / "tiny" / tiny_key(spec, template, seed)
    if not (entry / "config.json").exists():
        try:
            add_to_cache(entry, lambda scratch: _build(spec, template, seed, scratch))
        except OSError as error:
            log.warning("tiny model cache %s not writable (%s): building in the run", root, error)
            return _build(spec, template, seed, target)
    else:
        log.info("tiny %s model from the cache: %s", spec.architecture, entry)
    shutil.copytree(entry, target, dirs_exist_ok=True)
    return target


def tiny_key(spec: TinyModel, template: str, seed: int) -> str:
    """The hex digest naming the folder of (`spec`, `template`, `seed`) as this code and these
    library versions build it."""
    digest = hashlib.sha256()
    for part in (spec.model_dump_json(), template, str(seed)):
        digest.update(part.encode() + b"\0")
    for library in _LIBRARIES:
        digest.update(f"{library}=={importlib.metadata.version(library)}\0".encode())
    package = Path(mtprun.__file__).parent
    for source in _BUILDER_SOURCES:
        path = package / source
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(str(file.relative_to(package)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:32]


def _build(spec: TinyModel, template: str, seed: int, target: Path) -> Path:
    log.info("building a tiny %s model in %s", spec.architecture, target)
    # Here, not at module level: transformers' model classes (and the sklearn that its
    # generation utilities import) cost ~5 CPU-s, which a run from a folder or the cache skips.
    from mtprun.models.tiny import build_tiny_model

    return build_tiny_model(spec, build_tokenizer(template), target, seed)
