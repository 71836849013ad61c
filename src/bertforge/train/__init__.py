"""Training: the optimizer and schedule, the one training loop, distributed setup, run reports."""
