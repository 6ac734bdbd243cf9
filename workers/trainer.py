"""Trainer worker: owns agents' torch models and optimizers and executes training commands."""

from __future__ import annotations

from .session import CommandHandler


class TrainerHandler(CommandHandler):
    role = "trainer"
