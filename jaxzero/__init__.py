"""jaxzero: ZeRO and FSDP for JAX, as sharding layouts on a named device mesh.

Importing this package does not import JAX, so the command-line tools can set
up virtual CPU devices before JAX starts; ``jaxzero.Engine`` and its companions
(jaxzero.api) load on first use.
"""

__version__ = "0.1.0"

_API = ("Engine", "Zero", "Remat", "Offload", "Precision", "Pipeline", "Context", "mesh",
        "lora")


def __getattr__(name: str):
  if name in _API:
    from jaxzero import api  # pylint: disable=import-outside-toplevel
    return getattr(api, name)
  raise AttributeError(f"module 'jaxzero' has no attribute {name!r}")
