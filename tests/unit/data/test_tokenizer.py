"""Tokenizers: a trained byte-level BPE encodes exactly as the tokenizers library does; the
hash ignores formatting; EOS and bad directories are named."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer

from ray_moe.data.errors import DataError
from ray_moe.data.tokenizer import TextTokenizer, tokenizer_hash, train_bpe


def test_trained_bpe_encodes_like_the_library(bpe_dir, sample_texts):
    tok = TextTokenizer(bpe_dir)
    assert tok.vocab_size == 320 and tok.eos_token == "<|endoftext|>" and tok.eos_id == 0
    oracle = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    oracle.encode_special_tokens = True  # "<|endoftext|>" in a document is text, not its end
    texts = [*sample_texts, "", "héllo wörld ✓\n\ttabs", "<|endoftext|> inside"]
    ids, lengths = tok.encode_documents(texts)
    want = [oracle.encode(t, add_special_tokens=False).ids for t in texts]
    assert lengths.tolist() == [len(w) for w in want]
    assert ids.tolist() == [i for w in want for i in w]
    assert tok.eos_id not in want[-1] and oracle.decode(want[-1]) == texts[-1]
    assert oracle.decode(want[0]) == texts[0]  # byte-level: lossless
    assert sum(len(w) for w in want[:6]) < 0.75 * sum(len(t.encode()) for t in texts[:6])  # it merges


def test_hash_ignores_formatting_and_sees_changes(bpe_dir, tmp_path):
    obj = json.loads((bpe_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(obj))  # same content, other layout
    assert tokenizer_hash(tmp_path) == tokenizer_hash(bpe_dir)
    obj["model"]["merges"] = obj["model"]["merges"][:-1]
    (tmp_path / "tokenizer.json").write_text(json.dumps(obj))
    assert tokenizer_hash(tmp_path) != tokenizer_hash(bpe_dir)


def test_eos_comes_from_the_config_or_known_names(bpe_dir, tmp_path):
    shutil.copy(bpe_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    assert TextTokenizer(tmp_path).eos_token == "<|endoftext|>"  # no tokenizer_config.json: a known name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</nope>"}}))
    with pytest.raises(DataError, match="'</nope>' is not one of the tokenizer's tokens"):
        TextTokenizer(tmp_path)


def test_bad_tokenizer_directories_are_named(bpe_dir, tmp_path, sample_texts):
    with pytest.raises(DataError, match=r"tokenizer.json does not exist"):
        TextTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(DataError, match="not valid JSON"):
        TextTokenizer(tmp_path)
    with pytest.raises(DataError, match="already exists"):
        train_bpe(sample_texts, 300, bpe_dir)
    with pytest.raises(DataError, match="at least 257"):
        train_bpe(sample_texts, 100, tmp_path / "small")
