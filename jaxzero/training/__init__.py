"""The training loop and what surrounds it: evaluation, metrics, preemption, the workdir."""
