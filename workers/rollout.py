"""Rollout worker: hosts one inference engine and executes generation batches."""

from __future__ import annotations

from .session import CommandHandler


class RolloutHandler(CommandHandler):
    role = "rollout"
