"""ZeRO for any JAX model, as a library: :class:`Engine` with :class:`Zero`,
:class:`Remat`, :class:`Offload` and :func:`mesh`."""

from jaxzero.api.engine import Engine, Offload, Remat, Zero, mesh

__all__ = ["Engine", "Offload", "Remat", "Zero", "mesh"]
