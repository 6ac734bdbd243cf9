"""The episodes: the producer, the experience store, the batch schedule and synced versions, datasets, tokenizers, evaluation, and loading and reporting the user's code."""
