"""The training side: each agent's pipeline, trainer allocation and each trainer's command lanes, weight sync and its NCCL groups, checkpoints."""
