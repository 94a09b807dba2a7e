"""The in-memory training program: the train state, its sharded initialisation, the
optimizer, the composed jitted step. :class:`TrainProgram` builds them once per run
from a config and a ZeRO layout."""

from jaxzero.engine.lr_schedule import learning_rate_schedule
from jaxzero.engine.optimizer import (clip_by_norm, make_optimizer, mean_grad,
                                      padding_changes_updates, trained_alone)
from jaxzero.engine.program import TrainProgram
from jaxzero.engine.state import TrainState, dtype_of

__all__ = ["TrainProgram", "TrainState", "clip_by_norm", "dtype_of", "learning_rate_schedule",
           "make_optimizer", "mean_grad", "padding_changes_updates",
           "trained_alone"]
