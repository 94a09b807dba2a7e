"""ZeRO for any JAX model, as a library: :class:`Engine` with :class:`Zero`,
:class:`Remat`, :class:`Offload`, :class:`Precision`, :class:`Pipeline`, :class:`Context`
and :func:`mesh`, and :func:`lora` to fine-tune a model's LoRA adapters only."""

from jaxzero.api.adapters import lora
from jaxzero.api.engine import (Context, Engine, Offload, Pipeline, Precision, Remat, Zero,
                                mesh)

__all__ = ["Context", "Engine", "Offload", "Pipeline", "Precision", "Remat", "Zero", "lora",
           "mesh"]
