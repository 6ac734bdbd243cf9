"""The environment workers, as the controller sees them: routing the workflow's calls to them."""
