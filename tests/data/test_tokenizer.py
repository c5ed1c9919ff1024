from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mtprun.data.templates import get_chat_format
from mtprun.data.tokenizer import CHARACTERS, UNK_TOKEN, build_tokenizer, tokenizer_size


def test_every_character_and_special_token_round_trips(template: str) -> None:
    tokenizer = build_tokenizer(template)
    specials = "".join(get_chat_format(template).special_tokens)
    text = CHARACTERS + specials + CHARACTERS[::-1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 2 * len(CHARACTERS) + len(get_chat_format(template).special_tokens)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids


def test_tokenizer_size_is_the_built_tokenizers_length(template: str) -> None:
    # `mtprun plan` counts a tiny model's vocab without building the tokenizer (transformers).
    assert tokenizer_size(template) == len(build_tokenizer(template))


def test_characters_outside_the_vocabulary_become_unk() -> None:
    tokenizer = build_tokenizer("char")
    ids = tokenizer.encode("a\tb\u00e9", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", UNK_TOKEN, "b", UNK_TOKEN]


def test_eos_pad_and_template_are_set(template: str) -> None:
    tokenizer = build_tokenizer(template)
    assert tokenizer.eos_token == get_chat_format(template).eos_token
    assert tokenizer.pad_token_id == 0
    assert tokenizer.chat_template == get_chat_format(template).jinja


def test_unknown_template_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown chat template 'llama'.*char, chatml, glm"):
        build_tokenizer("llama")


def test_saved_tokenizer_loads_offline_in_transformers_and_vllm(tmp_path) -> None:
    tokenizer = build_tokenizer("glm")
    tokenizer.save_pretrained(tmp_path)
    text = "<|user|>\nWhat is 3*4?<|assistant|>\n12<|endoftext|>"
    expected = tokenizer.encode(text, add_special_tokens=False)

    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.encode(text, add_special_tokens=False) == expected
    assert reloaded.chat_template == tokenizer.chat_template

    from tokenizers.decoders import DecodeStream
    from vllm.tokenizers import get_tokenizer

    engine_tokenizer = get_tokenizer(str(tmp_path))
    assert engine_tokenizer.encode(text, add_special_tokens=False) == expected
    # vLLM detokenizes generated tokens one at a time with a DecodeStream.
    stream = DecodeStream(skip_special_tokens=False)
    pieces = [stream.step(engine_tokenizer.backend_tokenizer, i) or "" for i in expected]
    assert "".join(pieces) == text
