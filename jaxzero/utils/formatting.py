"""Numbers as people read them: bytes in GB/MB/KB, parameter counts in B/M."""

from __future__ import annotations

_BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def format_bytes(n: float, digits: int = 1, smallest: str = "MB") -> str:
  """`n` bytes in the largest unit of which it is at least a tenth (GB, MB, KB),
  never below `smallest`: 5e8 -> "0.5 GB", 1000 -> "0.0 MB"."""
  units = _BYTE_UNITS[:[u for u, _ in _BYTE_UNITS].index(smallest) + 1]
  unit, scale = next(((u, s) for u, s in units if n >= s / 10), units[-1])
  return f"{n / scale:.{digits}f} {unit}"


def bytes_unit(largest: float) -> tuple[float, str]:
  """(scale, unit) for a column of byte counts whose largest is `largest`: the
  largest unit that leaves it at least 10."""
  for unit, scale in _BYTE_UNITS:
    if largest >= 10 * scale:
      return scale, unit
  return 1.0, "bytes"


def format_count(n: int) -> str:
  """A parameter count: 1.24B, 49.15M."""
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
