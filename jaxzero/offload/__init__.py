"""State off the device: the NVMe store and its checkpoint item, one chunk's update, the
per-layer programs of ZeRO-Infinity, and the checks of offload targets. The runners that
use them are jaxzero.runners."""
