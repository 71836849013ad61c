"""The corpus reader moved to `bertforge.corpus` (below the tokenizer, which reads corpora too). These names
stay importable from here for callers not yet switched (demo.py)."""

from bertforge.corpus import expand_inputs, read_sentences

__all__ = ["expand_inputs", "read_sentences"]
