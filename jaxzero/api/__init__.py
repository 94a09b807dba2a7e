"""ZeRO for any JAX model, as a library: :class:`Engine` with :class:`Zero`,
:class:`Remat`, :class:`Offload` and :func:`mesh`, and :func:`lora` to fine-tune a model's
LoRA adapters only."""

from jaxzero.api.adapters import lora
from jaxzero.api.engine import Engine, Offload, Remat, Zero, mesh

__all__ = ["Engine", "Offload", "Remat", "Zero", "lora", "mesh"]
