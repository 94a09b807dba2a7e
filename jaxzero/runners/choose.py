"""The one place a runner is chosen: from the config's ``offload`` section.

``offload.optimizer=pinned_host`` keeps the optimizer state in host memory and updates it
there (ZeRO-Offload, the host runner); ``offload.optimizer=nvme`` streams it from files
(the NVMe runner), and with ``offload.params=nvme`` the weights and gradients too
(ZeRO-Infinity); otherwise the whole state is the in-memory runner's (weights in
pinned_host included: they stream inside the step). The chosen runner's targets are
checked before it is returned: a bad one costs one line.
"""

from __future__ import annotations

import pathlib

from jaxzero.engine import TrainProgram
from jaxzero.errors import ConfigError
from jaxzero.runners import host, infinity, nvme
from jaxzero.runners.base import InMemoryRunner, Runner


def make_runner(program: TrainProgram, workdir: str | pathlib.Path | None = None,
                check: bool = True) -> Runner:
  """The runner `program`'s config asks for; `workdir` names its NVMe store's
  directory (one per run and process); `check=False` only plans (nothing is read or
  written, and offload.nvme_dir may be unset)."""
  offload = program.cfg.offload
  if offload.optimizer == "pinned_host":
    runner = host.HostRunner(program)
  elif offload.optimizer != "nvme":
    runner = InMemoryRunner(program)
  else:
    kind = infinity.InfinityRunner if offload.params == "nvme" else nvme.NvmeRunner
    runner = kind(program, nvme.store_directory(offload.nvme_dir, workdir))
  if check and program.model.keyed_rows and not isinstance(runner, InMemoryRunner):
    # The offload runners take the step without its update (TrainProgram.grad_step),
    # which draws no per-row randomness.
    raise ConfigError(f"a model that draws randomness per row (Model.keyed_rows: dropout) "
                      f"with offload.optimizer={offload.optimizer}, offload.params="
                      f"{offload.params}: it trains with its optimizer state on the device; "
                      "set offload.optimizer=device"
                      + (" and offload.params=device or pinned_host" if offload.params == "nvme"
                         else "") + " (jaxzero.Offload(...) likewise)")
  if check:
    runner.check()
  return runner
