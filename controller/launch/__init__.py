"""Starting the workers: local processes or Ray actors, restarts of those that die."""
