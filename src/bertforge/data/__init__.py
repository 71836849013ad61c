"""Pretraining data: corpus reading and sentence splitting, sharded token storage, NSP instances, MLM masking
and the training-time loader (see each module)."""
