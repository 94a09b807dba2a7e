"""Before a run: per-device bytes, the memory check, the collectives report."""
