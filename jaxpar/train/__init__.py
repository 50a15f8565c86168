"""Compiled training step and the Trainer."""

from jaxpar.train.trainer import Trainer

__all__ = ["Trainer"]
