"""Text tokenizer: BPE trained with HF `tokenizers` on the training captions, or a tokenizer.json.

Captions become `[BOS] tokens [EOS]` padded with PAD to `model.text_len`; the empty caption (used
for the unconditional branch of super conditioning) is `[BOS] [EOS]`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from dalle_ablate.fileio import atomic_write
from dalle_ablate.registry import ConfigError

SPECIALS = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")
_PAD_NAMES = ("[PAD]", "<pad>", "<|pad|>")


def train_bpe(captions: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    # SentencePiece-style word boundaries: decodable, and a small vocabulary still reaches whole
    # words (a byte-level alphabet alone would take 256 entries).
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False)
    tok.train_from_iterator(captions, trainer=trainer)
    bos, eos = tok.token_to_id("[BOS]"), tok.token_to_id("[EOS]")
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", bos), ("[EOS]", eos)]
    )
    return tok


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, text_len: int, source: str = "trained"):
        self.tok = tokenizer
        self.text_len = text_len
        self.pad_id = next((i for n in _PAD_NAMES if (i := tokenizer.token_to_id(n)) is not None), None)
        if self.pad_id is None:
            raise ConfigError(f"tokenizer {source} has no padding token (one of {', '.join(_PAD_NAMES)})")
        self.tok.no_padding()
        self.tok.enable_truncation(max_length=text_len)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, captions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids [N, text_len] int32 and a mask [N, text_len] bool of real (non-PAD) tokens."""
        ids = np.full((len(captions), self.text_len), self.pad_id, np.int32)
        mask = np.zeros_like(ids, dtype=bool)
        for i, enc in enumerate(self.tok.encode_batch(list(captions))):
            ids[i, : len(enc.ids)] = enc.ids
            mask[i, : len(enc.ids)] = True
        return ids, mask

    def decode(self, ids: np.ndarray) -> list[str]:
        return self.tok.decode_batch([list(map(int, r)) for r in ids], skip_special_tokens=True)

    @classmethod
    def from_file(cls, path: str, text_len: int) -> "TextTokenizer":
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"data.tokenizer_path={path}: no such file (expected a tokenizer.json)")
        try:
            tok = Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise ConfigError(f"data.tokenizer_path={path} is not a tokenizer.json: {e}") from e
        return cls(tok, text_len, source=str(p))

    @classmethod
    def trained_or_cached(cls, captions: list[str], vocab_size: int, text_len: int, cache_dir: Path):
        """BPE on these captions, cached under a hash of the corpus and vocabulary size."""
        h = hashlib.sha256(f"bpe-v2|{vocab_size}|".encode())
        for c in captions:
            h.update(c.encode() + b"\n")
        path = Path(cache_dir) / "tokenizers" / f"bpe-{h.hexdigest()[:16]}.json"
        if path.is_file():
            return cls(Tokenizer.from_file(str(path)), text_len)
        tok = train_bpe(captions, vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, tok.to_str())  # whole or not at all; in a bucket's staged cache, uploaded (fileio)
        return cls(tok, text_len)
