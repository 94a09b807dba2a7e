"""The train state, its sharded initialisation, the optimizer and the jitted step.

:class:`Engine` builds them once per run from a config and a ZeRO layout.
"""

from jaxzero.engine.engine import Engine
from jaxzero.engine.optimizer import clip_by_norm, make_optimizer, mean_grad
from jaxzero.engine.schedules import learning_rate_schedule
from jaxzero.engine.state import TrainState, dtype_of

__all__ = ["Engine", "TrainState", "clip_by_norm", "dtype_of", "learning_rate_schedule",
           "make_optimizer", "mean_grad"]
