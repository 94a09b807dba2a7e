"""What the checkpoint checksums cost next to the save they protect.

    python scripts/checkpoint_bench.py [--config configs/tiny_zero3.py] [--saves 10]

Builds the config's train state on its mesh (virtual CPU devices here), then
times, per save: the whole save as the training loop does it (checksums included,
waiting until the files are in place), the checksums alone, and the
verification a restore adds. The checksum function is compiled once per run;
that time is reported separately.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxzero import cli  # pylint: disable=wrong-import-position


def main(argv=None) -> int:
  parser = cli.Parser(prog="checkpoint_bench.py", description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(ROOT / "configs" / "tiny_zero3.py"))
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field by its dotted name")
  parser.add_argument("--saves", type=int, default=10)
  args = parser.parse_args(argv)
  if args.saves < 1:
    parser.error(f"--saves={args.saves} must be at least 1")
  return cli.run_main("checkpoint_bench.py", lambda: _bench(args))


def _bench(args) -> None:
  cfg = cli.load_config(args).cfg  # before JAX starts: creates virtual CPU devices

  # pylint: disable=import-outside-toplevel
  import jax

  from jaxzero.checkpoint import checkpointer, integrity
  from jaxzero.training import loop

  run = loop.build(cfg, progress=False)
  state = jax.block_until_ready(run.program.init())
  t0 = time.perf_counter()
  integrity.record(state)
  compile_s = time.perf_counter() - t0

  checksum_s, save_s, verify_s = [], [], []
  with tempfile.TemporaryDirectory() as workdir:
    info = checkpointer.run_info(cfg.model, cfg.precision.compute, cfg.seed)
    with checkpointer.Checkpointer(workdir, args.saves + 1, info) as checkpoints:
      checkpoints.save(0, state, wait=True)  # orbax's own first-save setup
      for i in range(1, args.saves + 1):
        state = state._replace(step=state.step + 1)
        t0 = time.perf_counter()
        integrity.record(state)
        checksum_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checkpoints.save(i, state, wait=True)
        save_s.append(time.perf_counter() - t0)
      restored = checkpoints.restore(args.saves, run.program.abstract_state())
      for _ in range(args.saves):
        t0 = time.perf_counter()
        integrity.mismatches(restored, {})
        verify_s.append(time.perf_counter() - t0)

  n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.master))
  checksum, save, verify = (statistics.median(x) for x in (checksum_s, save_s, verify_s))
  print(f"config {args.config}: {n_params:,} parameters, {len(jax.devices())} "
        f"{jax.devices()[0].platform} devices, {args.saves} saves (medians)")
  print(f"  save, checksums included: {save * 1e3:8.1f} ms")
  print(f"  checksums:                {checksum * 1e3:8.1f} ms  "
        f"({100 * checksum / save:.1f}% of the save)")
  print(f"  verification on restore:  {verify * 1e3:8.1f} ms")
  print(f"  compiling the checksums:  {compile_s * 1e3:8.1f} ms, once per run")


if __name__ == "__main__":
  sys.exit(main())
