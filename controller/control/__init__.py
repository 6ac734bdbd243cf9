"""The control plane: the controller's one ROUTER socket, the worker registry, liveness."""
