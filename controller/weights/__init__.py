"""Moving an agent's weights from its trainer to its rollout instances: the weight sync and its NCCL groups."""
