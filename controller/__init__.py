"""The FlexMARL controller: one asyncio process that decides, and the pieces it wires."""

from .experiment import Experiment

__all__ = ["Experiment"]
