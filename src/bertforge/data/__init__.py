"""Pretraining data: preparation of a corpus (read by `bertforge.corpus`) into sharded token storage, NSP
instances, MLM masking and the training-time loader (see each module)."""
