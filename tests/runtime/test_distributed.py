"""Joining a multi-process run: where the coordinates come from, GPU flags, and
clear errors (not hangs) when the coordinator is wrong or a peer never comes."""

import importlib.util
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxzero.config import ConfigError, DistributedConfig
from jaxzero.runtime import xla_flags
from jaxzero.runtime.distributed import EXPLICIT, Peers, join_timeout_message, resolve

from processes import ROOT, TINY, child_env, free_port

SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[001-004]", "SLURM_NTASKS": "4",
         "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
LAUNCHED = {"JAXZERO_COORDINATOR": "10.0.0.1:1234", "JAXZERO_NUM_PROCESSES": "2",
            "JAXZERO_PROCESS_ID": "1"}


# ----------------------------------------------------------------------------- resolve


def test_no_environment_is_a_single_process():
  assert resolve(DistributedConfig(), {}) is None
  assert resolve(DistributedConfig(), {"SLURM_JOB_ID": "77"}) is None  # sbatch, outside srun


def test_jaxzero_variables_and_config_values_that_win_over_them():
  assert resolve(DistributedConfig(), LAUNCHED) == Peers("10.0.0.1:1234", 2, 1, EXPLICIT)
  ipv6 = {**LAUNCHED, "JAXZERO_COORDINATOR": "[fe80::1]:1234"}
  assert resolve(DistributedConfig(), ipv6) == Peers("[fe80::1]:1234", 2, 1, EXPLICIT)
  cfg = DistributedConfig(coordinator_address="10.0.0.9:99", process_id=0)
  assert resolve(cfg, LAUNCHED) == Peers("10.0.0.9:99", 2, 0, EXPLICIT)


def test_clusters_are_detected_and_explicit_values_win():
  assert resolve(DistributedConfig(), SLURM) == Peers(None, 4, 2, "SLURM")
  assert resolve(DistributedConfig(), {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
  assert resolve(DistributedConfig(), {**SLURM, **LAUNCHED}) == Peers("10.0.0.1:1234", 2, 1,
                                                                      EXPLICIT)
  mpi = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:3", "OMPI_COMM_WORLD_SIZE": "8",
         "OMPI_COMM_WORLD_RANK": "5"}
  assert resolve(DistributedConfig(), mpi) == Peers(None, 8, 5, "Open MPI")
  torchrun = {"WORLD_SIZE": "2", "RANK": "1"}
  assert resolve(DistributedConfig(), {**torchrun, **LAUNCHED}) == Peers("10.0.0.1:1234", 2, 1,
                                                                         EXPLICIT)
  assert resolve(DistributedConfig(), {**torchrun, "JAXZERO_NUM_PROCESSES": "1"}) is None
  assert resolve(DistributedConfig(), {"WORLD_SIZE": " "}) is None  # blank: unset
  # mpirun inside an srun step: JAX takes the Open MPI job, and so does jaxzero.
  assert resolve(DistributedConfig(), {**SLURM, **mpi}) == Peers(None, 8, 5, "Open MPI")


def test_a_kubernetes_job_needs_jax_k8s_unless_it_is_one_pod(monkeypatch):
  k8s = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "3"}
  with pytest.raises(ConfigError, match=re.escape(
      "a Kubernetes indexed Job (JOB_COMPLETION_INDEX=3) finds its peers through the "
      "Kubernetes API: pip install 'jax[k8s]', or set JAXZERO_NUM_PROCESSES=1 for a Job of "
      "one pod")):
    resolve(DistributedConfig(), k8s)
  one_pod = {**k8s, "JOB_COMPLETION_INDEX": "0", "JAXZERO_NUM_PROCESSES": "1"}
  assert resolve(DistributedConfig(), one_pod) is None
  found = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: object() if name == "kubernetes" else found(name, *a))
  assert resolve(DistributedConfig(), k8s) == Peers(None, None, 3, "Kubernetes")
  # A JobSet of one Job is that Job; of several, JAX would join each Job's pods apart.
  assert resolve(DistributedConfig(), {**k8s, "GLOBAL_REPLICAS": "1"}) == \
      Peers(None, None, 3, "Kubernetes")
  with pytest.raises(ConfigError, match=re.escape(
      "GLOBAL_REPLICAS=4: a JobSet of 4 Jobs, whose pods JAX joins Job by Job; set in each "
      "pod JAXZERO_COORDINATOR (Job 0's pod 0, host:port), JAXZERO_NUM_PROCESSES (4 x the "
      "pods of a Job) and JAXZERO_PROCESS_ID (JOB_GLOBAL_INDEX x the pods of a Job + "
      "JOB_COMPLETION_INDEX)")):
    resolve(DistributedConfig(), {**k8s, "GLOBAL_REPLICAS": "4", "JOB_GLOBAL_INDEX": "2"})
  explicit = {"JAXZERO_COORDINATOR": "job-0-0.js:1234", "JAXZERO_NUM_PROCESSES": "8",
              "JAXZERO_PROCESS_ID": "5"}
  assert resolve(DistributedConfig(), {**k8s, "GLOBAL_REPLICAS": "4", **explicit}) == \
      Peers("job-0-0.js:1234", 8, 5, EXPLICIT)


@pytest.mark.parametrize("cfg, environ, message", [
    (DistributedConfig(), {"JAXZERO_COORDINATOR": "10.0.0.1:1234"},
     "missing: JAXZERO_NUM_PROCESSES or distributed.num_processes, JAXZERO_PROCESS_ID or"),
    (DistributedConfig(), {**LAUNCHED, "JAXZERO_COORDINATOR": "10.0.0.1"},
     "coordinator address '10.0.0.1' must look like HOST:PORT"),
    (DistributedConfig(), {**LAUNCHED, "JAXZERO_COORDINATOR": "fe80::1"},
     "coordinator address 'fe80::1' must look like HOST:PORT, e.g. 10.0.0.1:1234 "
     "([fe80::1]:1234 for an IPv6 host)"),
    (DistributedConfig(coordinator_address=" 10.0.0.1:1234"), LAUNCHED,
     "coordinator address ' 10.0.0.1:1234' must look like HOST:PORT"),
    (DistributedConfig(), {**LAUNCHED, "JAXZERO_PROCESS_ID": "2"},
     "process id 2 is out of range for 2 processes (0..1)"),
    (DistributedConfig(), {**LAUNCHED, "JAXZERO_NUM_PROCESSES": "two"},
     "JAXZERO_NUM_PROCESSES='two' must be an integer >= 1"),
    (DistributedConfig(timeout_s=0), {}, "distributed.timeout_s=0 must be at least 1"),
    (DistributedConfig(process_id=-3), LAUNCHED,
     "distributed.process_id=-3 must be at least 0 (-1 = from the environment)"),
    (DistributedConfig(), {**LAUNCHED, "JAXZERO_NUM_PROCESSES": "\u00b2"},
     "JAXZERO_NUM_PROCESSES='\u00b2' must be an integer >= 1"),
    (DistributedConfig(), {**SLURM, "SLURM_NTASKS": ""},
     "SLURM_NTASKS is empty; the cluster's launcher sets it to an integer >= 1"),
    (DistributedConfig(), {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"},
     "OMPI_COMM_WORLD_SIZE=4 says this is one of several processes, as an Open MPI 5 job"),
    (DistributedConfig(), {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "10.0.0.1"},
     "WORLD_SIZE=2 says this is one of several processes, as a torchrun job sets it, whose "
     "peers JAX does not find: start the processes with srun or jaxzero.launch (one host), or "
     "set JAXZERO_COORDINATOR, JAXZERO_NUM_PROCESSES and JAXZERO_PROCESS_ID in each; if this "
     "is not a multi-process run, set JAXZERO_NUM_PROCESSES=1"),
    (DistributedConfig(), {"PMI_SIZE": "2", "PMI_RANK": "1"},
     "PMI_SIZE=2 says this is one of several processes, as an MPICH or Intel MPI job (Hydra's "
     "PMI) sets it"),
    (DistributedConfig(), {"MV2_COMM_WORLD_SIZE": "4"},
     "MV2_COMM_WORLD_SIZE=4 says this is one of several processes, as an MVAPICH2 job"),
])
def test_incomplete_or_bad_coordinates_are_one_clear_error(cfg, environ, message):
  with pytest.raises(ConfigError) as error:
    resolve(cfg, environ)
  assert message in str(error.value)


# ----------------------------------------------------------------------------- XLA GPU flags


def test_gpu_flags_are_added_and_user_values_win():
  user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
  merged = xla_flags.merge(user, xla_flags.GPU_DEFAULTS)
  assert merged.startswith(user)
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in merged
  assert "--xla_gpu_enable_pipelined_all_gather=true" in merged
  names = merged.split()
  assert len(names) == len(xla_flags.GPU_DEFAULTS) + 1  # no flag appears twice
  assert xla_flags.merge(merged, xla_flags.GPU_DEFAULTS) == merged


@pytest.mark.parametrize("environ, applied", [
    ({"JAX_PLATFORMS": "cuda"}, True),
    ({"JAX_PLATFORMS": "cpu"}, False),
    ({"JAX_PLATFORMS": "cuda", "JAXZERO_XLA_GPU_FLAGS": "0"}, False),
])
def test_gpu_flags_only_when_a_gpu_will_be_used(environ, applied):
  environ = dict(environ, XLA_FLAGS="--xla_gpu_all_gather_combine_threshold_bytes=1")
  assert xla_flags.apply_gpu_defaults(environ) is applied
  assert environ["XLA_FLAGS"].count("all_gather_combine_threshold_bytes") == 1
  assert ("--xla_gpu_enable_latency_hiding_scheduler=true" in environ["XLA_FLAGS"]) is applied


# ----------------------------------------------------------------------------- processes


JOIN_AND_SUM = textwrap.dedent("""
    import dataclasses, os
    from jaxzero import config
    from jaxzero.runtime import distributed
    cfg = dataclasses.replace(config.base(), mesh=config.MeshConfig(replica=1, fsdp=8),
                              distributed=config.DistributedConfig(timeout_s=60))
    distributed.initialize(cfg, prog="join")
    import jax, jax.numpy as jnp
    from jax.experimental import multihost_utils
    from orbax.checkpoint import multihost
    multihost.sync_global_processes("joined", processes=set(range(jax.process_count())))
    ranks = multihost_utils.process_allgather(jnp.int32(jax.process_index()))
    # A file, not stdout: gloo's own logging writes to stdout from C++ and can
    # land in the middle of a printed line.
    with open(os.environ["JOIN_RESULT"], "w") as f:
      f.write(f"devices {jax.local_device_count()} {jax.device_count()} ranks {ranks.tolist()}")
""")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_join_share_the_mesh_devices_and_talk(tmp_path):
  coordinator = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, "-c", JOIN_AND_SUM], cwd=ROOT, text=True, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      env=child_env(alone=True, JAXZERO_COORDINATOR=coordinator, JAXZERO_NUM_PROCESSES="2",
                    JAXZERO_PROCESS_ID=str(rank), JOIN_RESULT=str(tmp_path / f"rank{rank}")))
           for rank in range(2)]
  outputs = [p.communicate(timeout=120) for p in procs]
  for rank, (proc, (_, err)) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, err
    # The mesh names 8 devices: 4 in each process, 8 in all; gloo carries the gather.
    assert (tmp_path / f"rank{rank}").read_text() == "devices 4 8 ranks [0, 1]", err


def train_alone(tmp_path, rank: int, coordinator: str, timeout_s: int) -> subprocess.Popen:
  """One process of a two-process run whose other process never starts."""
  return subprocess.Popen(
      [sys.executable, "-m", "jaxzero.train", "--config", TINY, "--workdir", str(tmp_path / "w"),
       "--set", f"distributed.timeout_s={timeout_s}", "--set",
       f"distributed.coordinator_address={coordinator}"],
      cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      env=child_env(alone=True, JAXZERO_NUM_PROCESSES="2", JAXZERO_PROCESS_ID=str(rank)))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_missing_peer_and_wrong_coordinator_fail_within_the_timeout(tmp_path):
  timeout_s = 10
  address = f"127.0.0.1:{free_port()}"
  started = time.monotonic()
  # Process 0 serves the coordinator and waits for a process 1 that never comes;
  # a process 1 elsewhere looks for a coordinator where nothing listens.
  alone = train_alone(tmp_path, 0, address, timeout_s)
  lost = train_alone(tmp_path, 1, f"127.0.0.1:{free_port()}", timeout_s)
  for proc, message in (
      (alone, f"process 0 of 2: not all 2 processes joined the run at {address} within "
              f"distributed.timeout_s={timeout_s} s"),
      (lost, "process 1 of 2 found no coordinator at 127.0.0.1:")):
    _, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], err
    assert errors[0].startswith("jaxzero.train: error: ")
    assert "Traceback" not in err and "Check failure" not in err
    # The configured timeout, plus starting Python and importing JAX on a busy machine.
    assert timeout_s <= elapsed < timeout_s + 40
  assert not (tmp_path / "w" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_coordinator_port_in_use_is_one_line_naming_it(tmp_path):
  """JAX says only "Failed to start RPC server" (or crashes); the port is named."""
  with socket.socket() as holder:
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("", 0))
    holder.listen()
    port = holder.getsockname()[1]
    _, err = (proc := train_alone(tmp_path, 0, f"127.0.0.1:{port}", 20)).communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1] == (
        "jaxzero.train: error: process 0 could not join the run (config or JAXZERO_* "
        f"variables): port {port} of the coordinator address 127.0.0.1:{port} is in use on "
        "this host; choose another port")
    # A SLURM step: JAX picks the port (JAX_COORDINATOR_PORT here); process 0 segfaulted.
    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                 SLURM_PROCID="0", SLURM_LOCALID="0", JAX_COORDINATOR_PORT=str(port))
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxzero.train", "--config", TINY, "--workdir",
         str(tmp_path / "w")], cwd=ROOT, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=child_env(alone=True, **slurm))
    _, err = proc.communicate(timeout=120)
  assert proc.returncode == 2, err
  assert err.strip().splitlines()[-1] == (
      f"jaxzero.train: error: process 0 could not join the run (SLURM): port {port} of JAX's "
      "coordinator for SLURM (JAX_COORDINATOR_PORT, else from the job id) is in use on this "
      "host; choose another port with JAX_COORDINATOR_PORT")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_processes_started_with_different_settings_stop_in_one_line(tmp_path):
  """Process 1 with another train.lr trained its shards at it, silently; another seq_len
  aborted in gloo, another --steps hung. Every process now names the difference."""
  coordinator = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jaxzero.train", "--config", TINY, "--workdir", str(tmp_path / "w"),
       "--set", f"distributed.coordinator_address={coordinator}",
       *(["--set", "train.lr=0.1"] if rank else [])],
      cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      env=child_env(alone=True, JAXZERO_NUM_PROCESSES="2", JAXZERO_PROCESS_ID=str(rank)))
           for rank in range(2)]
  for proc in procs:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1] == (
        "jaxzero.train: error: process 1 was started with train.lr=0.1, process 0 with "
        "train.lr=0.003; start every process with the same config and options"), err
  assert not (tmp_path / "w" / "metrics.jsonl").exists()


def test_the_port_jax_picks_for_a_clusters_coordinator_is_the_one_checked():
  """JAX's SlurmCluster and OmpiCluster rule (job id modulo 4096, past 61440), checked for
  being in use before process 0 serves it; JAX_COORDINATOR_PORT wins."""
  from jaxzero.runtime import distributed  # pylint: disable=import-outside-toplevel
  cluster_port = distributed._jax_cluster_port  # pylint: disable=protected-access
  assert cluster_port(Peers(None, 2, 0, "SLURM"), {"SLURM_JOB_ID": "7"}) == "61447"
  uri = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
  assert cluster_port(Peers(None, 2, 0, "Open MPI"), uri) == "62624"
  assert cluster_port(Peers(None, None, 0, "Kubernetes"), {}) == ""


def test_a_coordinator_host_that_does_not_resolve_is_said_so():
  peers = Peers("nosuchhost.invalid:1234", 2, 1, EXPLICIT)
  assert "found no coordinator at nosuchhost.invalid:1234 within distributed.timeout_s=5 s: " \
         "the host 'nosuchhost.invalid' does not resolve;" in join_timeout_message(peers, 5)


def test_a_mesh_of_minus_one_never_stops_a_run_of_any_process_count():
  """fsdp=-1 takes the devices there are: 32 processes of one GPU each (or 3 on a CPU)
  run, where a count that does not divide 8 used to be refused before joining. A mesh
  that names its size must still be shared evenly."""
  from jaxzero import config
  from jaxzero.runtime import distributed
  for processes in (3, 32):
    distributed._share_virtual_devices(config.load(TINY, ["mesh.fsdp=-1"]), processes)
  with pytest.raises(ConfigError, match="= 8 devices cannot be shared evenly by 3 processes"):
    distributed._share_virtual_devices(config.load(TINY, ["mesh.fsdp=8"]), 3)
