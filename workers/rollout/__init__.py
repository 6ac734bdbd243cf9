"""The rollout worker: a vLLM engine behind the worker session, groups in and out, weights loaded from the parameter channel."""
