"""Fine-tuning a pretrained model on a task, sweeps over learning rates and seeds, and the comparison of two
starting points (pretrained against random weights), through the one training loop of `bertforge.train`."""
