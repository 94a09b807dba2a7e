"""XLA's own log lines go to a file, counted in one line; everything else on standard
error passes through as it comes."""

import os

from jaxzero.runtime import xla_log

REMAT = (b"W1127 18:30:19.856712    9399 spmd_partitioner.cc:656] [SPMD] Involuntary full "
         b"rematerialization. The compiler cannot go from sharding {...} to {...}\n")
OTHER = b"E1127 18:30:20.000001    9399 cpu_compiler.cc:12] something else\n"


def test_xla_lines_go_to_the_log_and_the_rest_passes_through(tmp_path, capfd):
  log = tmp_path / "w" / "plan.log"
  with xla_log.xla_lines_to(log) as counts:
    os.write(2, REMAT)
    os.write(2, b"a line of our own\n")
    os.write(2, REMAT + OTHER)
  assert counts == {"remat": 2, "other": 1}
  assert log.read_bytes() == REMAT + REMAT + OTHER
  assert capfd.readouterr().err == "a line of our own\n"
  assert xla_log.summary(counts, log) == (
      f"XLA rematerialised 2 buffers it could not reshard efficiently and logged 1 other line "
      f"(see {log})")


def test_nothing_logged_makes_no_file_and_no_line(tmp_path):
  with xla_log.xla_lines_to(tmp_path / "plan.log") as counts:
    pass
  assert not (tmp_path / "plan.log").exists() and xla_log.summary(counts, "x") == ""


def test_a_log_that_cannot_be_written_passes_the_lines_through(tmp_path, capfd):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with xla_log.xla_lines_to(blocker / "plan.log") as counts:  # a file is no directory
    os.write(2, REMAT)
  err = capfd.readouterr().err
  assert "cannot go to" in err and REMAT.decode() in err
  assert xla_log.summary(counts, "x") == ""
