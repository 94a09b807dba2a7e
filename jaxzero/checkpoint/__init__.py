"""Checkpoints: orbax I/O, checksums, and one-line reports of failed reads."""
