"""The rollout side: the instances and what each serves, routing groups to them, level-1 balancing between agents, rejoining workers, and the simulator that drives these rules at scale."""
