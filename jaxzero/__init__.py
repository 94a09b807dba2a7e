"""jaxzero: ZeRO and FSDP for JAX, as sharding layouts on a named device mesh.

Importing this package does not import JAX, so the command-line tools can set
up virtual CPU devices before JAX starts.
"""

__version__ = "0.1.0"
