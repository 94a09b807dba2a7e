"""State off the device: the NVMe tier (ZeRO-Infinity) and its checkpoint item."""
