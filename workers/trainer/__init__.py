"""The trainer worker: torch models and optimizers, packed micro-batches, the loss, publishing weights; a trainer group of several ranks."""
