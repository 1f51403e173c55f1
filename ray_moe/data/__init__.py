"""Text data: input files, tokenizers, the token-shard format and the Ray Data preparation job.

``inputs.py`` (which files, which documents, is it text) → ``tokenizer.py`` (a Hugging Face
``tokenizer.json`` through the ``tokenizers`` library; byte-level BPE training) → ``prepare.py``
(the Ray Data job: read → tokenize in the workers → the driver's ``writer.py``, fixed-size shards
written durably and resumably) → ``shards.py`` (the on-disk format: shards, ``index.json``,
``meta.json``, and the memory-mapped reader) and ``mixture.py`` (which dataset and window each
row of a global batch reads). ``errors.py``: ``DataError``.

Nothing here imports torch: the modules run inside Ray Data workers, which should start fast.
"""
