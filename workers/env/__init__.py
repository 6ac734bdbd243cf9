"""The environment worker: the workflow's tool, environment and reward functions in process pools."""
