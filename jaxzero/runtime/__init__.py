"""The process around a run: joining other processes, watching them, XLA flags."""
