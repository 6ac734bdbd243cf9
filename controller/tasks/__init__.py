"""Built-in tasks, each a user of the workflow API like any user's job: the digit chain (the embedded default of `make run`, registered by name in episodes/user_code.py)."""
