#!/usr/bin/env bash
# The single-GPU figures of README and docs/benchmarks.md, in one run, most wanted first:
#
#     scripts/gpu_bench.sh OUT_DIR [SECONDS]
#
#   1. the machine: GPU, JAX and library versions, disks;
#   2. ZeRO-Offload at scale: Llama-3.1-8B on one GPU with the optimizer in host memory,
#      through jaxzero.train (3 steps, grad_accum 1; peak RSS by /usr/bin/time, the device's
#      peak in the first-step line);
#   3. the README's first command, the embedded default, as a newcomer types it;
#   4. the 1B shape through jaxzero.train: the start-up line (plan against memory_stats),
#      tokens/s and MFU;
#   5. scripts/offload_bench.py on the 1B shape at grad_accum 8 (no offload, offload, DPU;
#      the host's update against its copy bandwidth);
#   6. the 8B offload at grad_accum 8;
#   7. scripts/bench.py on configs/llama1b_bench.py: attention "auto" (cuDNN), then FP8
#      matmuls (precision.matmul=fp8), then PyTorch in the same run;
#   8. `jaxzero.plan` of configs/llama70b_infinity.py compiled by XLA:GPU, the NVMe tier
#      (scripts/infinity_bench.py on a 0.55 B Llama, the device capped below its 8.8 GB
#      state), XLA attention, the 1B step with the weights in pinned host memory too.
#
# Each step writes OUT_DIR/NAME.log (and its JSON); each gets at most what is left of SECONDS
# (default 470), so a slow step costs the later ones, never the whole run. ONLY="NAME ..."
# runs those steps alone.
set -u
out=${1:?usage: scripts/gpu_bench.sh OUT_DIR [SECONDS]}
deadline=$(( $(date +%s) + ${2:-470} ))
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# One compilation cache for every step: the runs of one shape (offload_bench's three
# processes, bench.py after train) compile each program once. Step times are unaffected;
# the "compiled in" lines of later steps are cache hits.
export JAX_COMPILATION_CACHE_DIR="${TMPDIR:-/tmp}/jaxzero-bench-cache"
python=${PYTHON:-python3}

step() {  # step NAME CAP_SECONDS COMMAND...: runs COMMAND for at most CAP, within the deadline
  local name=$1 cap=$2 left; shift 2
  [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]] && return
  left=$(( deadline - $(date +%s) ))
  (( left < cap )) && cap=$left
  if (( cap < 20 )); then echo "== $name: skipped, ${left}s left"; return; fi
  echo "== $name (at most ${cap}s): $*"
  local start=$(date +%s)
  timeout -k 5 "$cap" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $?, $(( $(date +%s) - start ))s"
  tail -n 25 "$out/$name.log"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $python - <<'EOF'
import importlib.metadata as m
print({p: m.version(p) for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex",
                                  "tensorstore", "tensorboardX", "numpy", "torch", "transformers")})
import jax
print(jax.devices(), jax.devices()[0].device_kind)
EOF
  df -h / /tmp "$PWD" 2>/dev/null; free -g; nproc
} >"$out/machine.log" 2>&1
cat "$out/machine.log"

# The local disk with the most room, for the NVMe tier's files.
nvme=$($python -c "import shutil,sys; print(max(sys.argv[1:], key=lambda p: shutil.disk_usage(p).free))" /tmp "$PWD" /root)/jaxzero-nvme
mkdir -p "$nvme"

# The issue's command, as a user types it (no XLA or pool variable set), with nothing saved
# at the end (checkpoint.at_end=false: the 8B state would not fit this disk).
offload8b="--config configs/llama8b_zero3.py --set mesh.fsdp=1 --set train.global_batch=1 \
  --set train.seq_len=4096 --set offload.optimizer=pinned_host --set remat.policy=full \
  --steps 3 --no-progress --set train.log_every=1 --set checkpoint.at_end=false"
step train8b_offload 200 /usr/bin/time -v $python -m jaxzero.train $offload8b \
  --set train.grad_accum=1 --workdir "$out/run8b_accum1"
step readme_tiny 45 $python -m jaxzero.train --config configs/tiny_zero3.py --no-progress \
  --workdir "$out/run_tiny"
step train1b 60 $python -m jaxzero.train --config configs/llama1b_bench.py --steps 10 \
  --set checkpoint.at_end=false \
  --no-progress --set train.log_every=1 --workdir "$out/run1b"
step offload1b 200 sh -c "$python scripts/offload_bench.py --config configs/llama1b_bench.py \
  --set train.global_batch=64 --set train.grad_accum=8 --steps 3 --json >'$out/offload1b.json'"
step train8b_offload_accum8 200 /usr/bin/time -v $python -m jaxzero.train $offload8b \
  --set train.global_batch=8 --set train.grad_accum=8 --workdir "$out/run8b_accum8"
step bench1b_cudnn 110 $python scripts/bench.py --config configs/llama1b_bench.py --steps 10 --warmup 3 \
  --json "$out/bench1b_cudnn.json"
step bench1b_fp8 110 $python scripts/bench.py --config configs/llama1b_bench.py --steps 10 --warmup 3 \
  --set precision.matmul=fp8 --json "$out/bench1b_fp8.json"
step bench1b_torch 200 $python scripts/bench.py --config configs/llama1b_bench.py --steps 10 --warmup 3 \
  --torch --json "$out/bench1b_torch.json"
step plan70b 90 $python -m jaxzero.plan --config configs/llama70b_infinity.py
step infinity 170 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.04 $python scripts/infinity_bench.py \
  --nvme-dir "$nvme" --dim 2048 --layers 8 --mlp 8192 --heads 32 --kv-heads 8 --vocab 32000 \
  --seq 4096 --steps 3 --seq-gb 2 --tflops 790
rm -rf "$nvme"
step bench1b_xla 110 $python scripts/bench.py --config configs/llama1b_bench.py --steps 10 --warmup 3 \
  --set model.attention=xla --json "$out/bench1b_xla.json"
step bench1b_offload_all 90 $python scripts/bench.py --config configs/llama1b_bench.py --steps 5 --warmup 2 \
  --set offload.optimizer=pinned_host --set offload.params=pinned_host --json "$out/bench1b_offload_all.json"
echo "== done, $(( deadline - $(date +%s) ))s to spare"
