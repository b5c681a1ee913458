"""A small tokenizer made by our own code, saved into every checkpoint we create.

WordPiece over a vocabulary generated here: the special tokens, every printable ASCII character
(alone and as a word continuation, so any English prompt tokenizes without unknowns), then a
list of common prompt words so short prompts become short token sequences.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
# EOS is not id 2: CLIP's pooling treats eos_token_id == 2 as "take the largest token id"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)
BOS_ID, EOS_ID, PAD_ID = 2, 3, 0

_WORDS = (
    "a an the of with and in on at to from by for is are photo picture image painting drawing "
    "render video of cat dog bird fish horse cow sheep lion tiger bear fox wolf rabbit mouse "
    "red green blue yellow orange purple pink black white gray brown gold silver "
    "big small tiny large tall short round square circle triangle star heart "
    "sky sea ocean river lake mountain forest tree flower grass sun moon night day city street "
    "house car boat train plane road bridge tower castle garden beach snow rain cloud fire "
    "man woman child person people face hand sign text word letter says reads written "
    "sitting standing running flying swimming walking jumping holding wearing "
    "beautiful bright dark colorful simple detailed realistic style art oil watercolor "
    "high quality best one two three four five many background center left right top bottom"
).split()


def vocabulary() -> list[str]:
    chars = [c for c in string.printable if not c.isspace() and not c.isupper()]
    vocab = list(SPECIAL_TOKENS) + chars + ["##" + c for c in chars]
    seen = set(vocab)
    for word in _WORDS:
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    return vocab


def build_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    # imported here: the families read this module's ids, and the run's driver imports the families
    # without ever building a tokenizer (transformers is about 1 CPU-s of imports per process)
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(vocabulary())}
    assert vocab[BOS] == BOS_ID and vocab[EOS] == EOS_ID and vocab[PAD] == PAD_ID
    core = Tokenizer(models.WordPiece(vocab, unk_token=UNK, max_input_chars_per_word=100))
    core.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, BOS_ID), (EOS, EOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        model_max_length=model_max_length,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="right",
    )
