"""A run's tiny model folder through the cache (`mtprun.runner.run.tiny_folder`): the copy is
the folder a direct build writes, later runs of the same model copy it without building, a
different model gets its own entry, and a cache turned off or not writable still yields the
folder."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from mtprun.runner.cache import CACHE_ENV, cache_root
from mtprun.runner.run.tiny_folder import tiny_key, tiny_model_folder
from mtprun.spec.model import TinyModel

from .conftest import TINY

LOGGER = "mtprun.runner.run.tiny_folder"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_runs_of_one_model_copy_the_folder_built_once(tmp_path, monkeypatch, caplog):
    spec, seed = TinyModel(**TINY), random.randrange(1000)
    monkeypatch.setenv(CACHE_ENV, "")
    direct = tiny_model_folder(spec, "chatml", seed, tmp_path / "direct")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        caplog.clear()  # the direct build's record, where an earlier test left INFO on
        first = tiny_model_folder(spec, "chatml", seed, tmp_path / "run1" / "model")
        second = tiny_model_folder(spec, "chatml", seed, tmp_path / "run2" / "model")
    assert _files(first) == _files(second) == _files(direct)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_files(first))
    entries = list((tmp_path / "cache" / "tiny").iterdir())
    assert [e.name for e in entries] == [tiny_key(spec, "chatml", seed)]  # no scratch left
    messages = [r.getMessage() for r in caplog.records]
    assert sum("building" in m for m in messages) == 1  # the first run, into the cache
    assert sum("from the cache" in m for m in messages) == 1  # the second


def test_the_key_names_the_model_template_and_seed():
    spec = TinyModel(**TINY)
    key = tiny_key(spec, "chatml", 1)
    assert key == tiny_key(TinyModel(**TINY), "chatml", 1)
    others = {
        tiny_key(spec, "chatml", 2),
        tiny_key(spec, "glm", 1),
        tiny_key(TinyModel(**{**TINY, "layers": TINY["layers"] + 1}), "chatml", 1),
    }
    assert key not in others and len(others) == 3


def test_an_empty_cache_variable_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "")
    assert cache_root() is None
    folder = tiny_model_folder(TinyModel(**TINY), "char", 0, tmp_path / "model")
    assert (folder / "config.json").exists()
    assert list(tmp_path.iterdir()) == [folder]


def test_a_cache_that_cannot_be_written_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the cache would go")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        folder = tiny_model_folder(TinyModel(**TINY), "char", 0, tmp_path / "model")
    assert (folder / "config.json").exists()
    assert any("not writable" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", None])
def test_the_default_cache_is_under_the_users_cache_home(tmp_path, monkeypatch, variable):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if variable is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        assert cache_root() == tmp_path / "home" / ".cache" / "mtprun"
    else:
        monkeypatch.setenv(variable, str(tmp_path / "xdg"))
        assert cache_root() == tmp_path / "xdg" / "mtprun"
