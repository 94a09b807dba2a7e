"""Model FLOPs and MFU: the figures a training log shows beside the loss.

Model FLOPs per token are jaxzero.planning.flops's. MFU is model TFLOP/s over the
devices' bf16 dense peak, where the device is known (a CPU has none).
"""

from __future__ import annotations

# bf16 dense peak per device, TFLOP/s (vendor datasheets, without sparsity), the first
# name in the device kind wins. The H100 figure is the SXM part's; PCIe and NVL H100s peak
# lower.
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "H200": 989.4,
               "A100": 312.0}


def device_peak_tflops(device) -> float | None:
  kind = getattr(device, "device_kind", "")
  return next((peak for name, peak in PEAK_TFLOPS.items() if name in kind), None)
