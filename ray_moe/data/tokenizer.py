"""Tokenizers: any Hugging Face tokenizer directory (``tokenizer.json``) through the
``tokenizers`` library, and a byte-level BPE trained locally (``ray-moe tokenizer train``).

A tokenizer's identity is the sha256 of its ``tokenizer.json`` in canonical JSON form (keys
sorted, no whitespace), so a re-saved or reformatted file keeps its hash and any change to the
vocabulary, merges, normalizer or pre-tokenizer changes it. Documents are encoded without the
tokenizer's own special tokens (no BOS); the preparation job ends each with the EOS token.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ray_moe.data.errors import DataError, load_json

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
DEFAULT_EOS = "<|endoftext|>"
# Tried in order when the directory names no eos_token (GPT-2/Qwen, Llama/Mistral, Llama 3, Gemma).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def tokenizer_hash(directory: str | Path) -> str:
    """sha256 (hex) of ``directory/tokenizer.json`` in canonical JSON form."""
    path = Path(directory) / TOKENIZER_FILE
    obj = load_json(path, "does not exist; a tokenizer directory holds a Hugging Face tokenizer.json")
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def load_for_documents(tokenizer_json: str) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` text, set to encode special-token text
    inside documents as plain text: a document that contains "<|endoftext|>" must not end there
    (only the preparation job puts EOS between documents)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.encode_special_tokens = True
    return tok


class TextTokenizer:
    """A loaded tokenizer: ``vocab_size`` (one more than its largest id), ``eos_id``, ``hash``."""

    def __init__(self, directory: str | Path):
        self.directory = str(Path(directory).expanduser().resolve())
        self.hash = tokenizer_hash(self.directory)
        try:
            self.tokenizer = load_for_documents((Path(self.directory) / TOKENIZER_FILE).read_text(encoding="utf-8"))
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise DataError(f"{self.directory}/{TOKENIZER_FILE}: the tokenizers library cannot load it ({exc})") from None
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eos_token = _eos_token(self.directory, vocab)
        self.eos_id = vocab[self.eos_token]

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what Ray workers load it from)."""
        return self.tokenizer.to_str()

    def describe(self) -> dict:
        """What a prepared dataset records about its tokenizer."""
        return {"hash": self.hash, "vocab_size": self.vocab_size, "eos_token": self.eos_token,
                "eos_id": self.eos_id, "directory": self.directory}

    def encode_documents(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """See :func:`encode_documents`."""
        return encode_documents(self.tokenizer, texts)


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Batch-encode documents with a ``tokenizers.Tokenizer`` (no special tokens added, no EOS;
    the tokenizer should have ``encode_special_tokens`` set, see :func:`load_for_documents`).

    Returns (ids uint32 [sum of lengths], lengths int64 [len(texts)]): the documents' ids back
    to back.
    """
    encodings = tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
    per_doc = [e.ids for e in encodings]
    lengths = np.fromiter(map(len, per_doc), dtype=np.int64, count=len(per_doc))
    ids = np.fromiter(itertools.chain.from_iterable(per_doc), dtype=np.uint32, count=int(lengths.sum()))
    return ids, lengths


def _eos_token(directory: str, vocab: dict[str, int]) -> str:
    named = None
    for name in (CONFIG_FILE, SPECIAL_MAP_FILE):
        path = Path(directory) / name
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get("eos_token")
            except ValueError as exc:
                raise DataError(f"{path} is not valid JSON ({exc})") from None
            named = value.get("content") if isinstance(value, dict) else value
            if named:
                break
    if named:
        if named not in vocab:
            raise DataError(f"{directory}: eos_token {named!r} is not one of the tokenizer's tokens")
        return named
    for candidate in EOS_CANDIDATES:
        if candidate in vocab:
            return candidate
    raise DataError(f"{directory}: no end-of-document token; set \"eos_token\" in {CONFIG_FILE} "
                    f"to one of the tokenizer's tokens (tried {', '.join(EOS_CANDIDATES)})")


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path, min_frequency: int = 2,
              eos_token: str = DEFAULT_EOS) -> TextTokenizer:
    """Train a byte-level BPE (GPT-2 style: any text encodes, nothing is unknown) of
    ``vocab_size`` tokens (256 byte tokens, ``eos_token``, merges) and save it to ``out_dir``
    as ``tokenizer.json`` + ``tokenizer_config.json`` (loadable by ``transformers`` too).
    Refuses an ``out_dir`` that already holds a tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"--vocab-size {vocab_size}: must be at least 257 (256 byte tokens + the end-of-document token)")
    out = Path(out_dir).expanduser()
    if (out / TOKENIZER_FILE).exists():
        raise DataError(f"{out / TOKENIZER_FILE} already exists; choose another --out (nothing was overwritten)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    seen = [0]

    def counted(it: Iterable[str]) -> Iterable[str]:
        for t in it:
            seen[0] += 1
            yield t

    tok.train_from_iterator(counted(texts), trainer)
    if seen[0] == 0:
        raise DataError("no text to train the tokenizer on (every input document is empty)")
    out.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": eos_token,
              "unk_token": None, "clean_up_tokenization_spaces": False, "add_prefix_space": False}
    _write_atomic(out / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    _write_atomic(out / TOKENIZER_FILE, tok.to_str(pretty=True))  # last: its presence means complete
    return TextTokenizer(out)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
