"""A character-level tokenizer with a chat template, built locally for the tiny models.

tokenizers and transformers are imported where a tokenizer is built: `tokenizer_size` (what
`mtprun plan` needs of a tiny model's tokenizer) does without them (~1.7 CPU-seconds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mtprun.data.templates import get_chat_format

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
# Printable ASCII and the newline: what the synthetic tasks and plain-English data need.
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))


def build_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer with one token per character plus `template`'s special tokens.

    `template` is a chat format name ("char", "chatml" or "glm"); the tokenizer carries its
    Jinja `chat_template`, its eos token, and pad/unk tokens. Ids: pad 0, unk 1, then the
    template's special tokens, then the characters. Characters outside CHARACTERS encode to
    unk. `save_pretrained` writes a folder that vLLM and `AutoTokenizer` load offline.
    """
    chat_format = get_chat_format(template)
    return build_char_tokenizer(
        chat_format.special_tokens, chat_format.eos_token, chat_format.jinja
    )


def tokenizer_size(template: str) -> int:
    """`len(build_tokenizer(template))`, without building it."""
    return len(_char_vocab(_specials(get_chat_format(template).special_tokens)))


def _specials(special_tokens: Sequence[str]) -> list[str]:
    return [PAD_TOKEN, UNK_TOKEN, *special_tokens]


def _char_vocab(specials: list[str]) -> dict[str, int]:
    return {token: i for i, token in enumerate([*specials, *CHARACTERS])}


def build_char_tokenizer(
    special_tokens: Sequence[str], eos_token: str, chat_template: str
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with `special_tokens` (each one token, `eos_token` among
    them) and any Jinja `chat_template`, laid out as `build_tokenizer` describes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = _specials(special_tokens)
    vocab = _char_vocab(specials)

    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # Every character is its own word; special tokens are split out before this runs.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens without the separator WordLevel would otherwise put between them.
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos_token,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=chat_template,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
