#!/usr/bin/env bash
# The GPU paths on a lent device machine (one GPU; every rank shares cuda:0), as one script:
#   1. tests/mpi/test_ps_practices.py with CUDA models (HPCASYNC_TEST_DEVICE=cuda): the PS rules,
#      odsgd, daso, ssgd in a user's loop;
#   2. the comm layer's device staging (experiments/probes/gpu_comm_check.py);
#   3. `hpcasync train --device auto` for each family;
#   4. the own-loop example (examples/train_mnist.py) on the GPU.
# Needs Open MPI and mpi4py as wheels in .whl/ (the machine's image has neither built for it).
# Usage, in the repo root there:  bash experiments/probes/gpu_check.sh OUTDIR
set -u
out=${1:-/tmp/gpu-check}
mkdir -p "$out/logs"
python3 -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/mpi .whl/*.whl || exit 1
export PATH=/tmp/mpi/bin:$PATH LD_LIBRARY_PATH=/tmp/mpi/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/mpi/lib/python3.12/site-packages:$PWD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi
export OMPI_MCA_osc=^ucx OMPI_MCA_mpi_yield_when_idle=1 PYTHONUNBUFFERED=1 HPCASYNC_TUNE_FILE=none
summary=$out/summary.txt
{
    date -u; nvidia-smi -L; nproc; uptime
    python3 -c "import torch, mpi4py.MPI as M; print('torch', torch.__version__, torch.cuda.get_device_name(0)); print(M.Get_library_version().splitlines()[0])"
} > "$summary" 2>&1
run() {      # run NAME CMD...: its log in logs/, its status, time and last lines in the summary
    local name=$1; shift
    local t0; t0=$(date +%s.%N)
    timeout 300 "$@" > "$out/logs/$name.log" 2>&1
    local rc=$?
    printf '\n== %s: exit %s, %s s (load %s)\n' "$name" "$rc" \
        "$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")" "$(cut -d' ' -f1 /proc/loadavg)" \
        >> "$summary"
    grep -a -E "passed|failed|error|Error|accuracy|mismatch|equal to|MISMATCH|test_accuracy" \
        "$out/logs/$name.log" | tail -n 12 >> "$summary"
}
run practices env HPCASYNC_TEST_DEVICE=cuda mpiexec --oversubscribe -n 4 python3 -m mpi4py \
    -m pytest -q -p no:cacheprovider tests/mpi/test_ps_practices.py
run comm mpiexec --oversubscribe -n 2 python3 experiments/probes/gpu_comm_check.py
train="python3 -m hpcasync.cli train --dataset fashion-mnist-mini --train-limit 6000 --epochs 2 --progress off --device auto"
run cli-ssgd mpiexec --oversubscribe -n 2 $train --algorithm ssgd --metrics "$out/logs/ssgd.jsonl"
run cli-odsgd mpiexec --oversubscribe -n 2 $train --algorithm odsgd --metrics "$out/logs/odsgd.jsonl"
run cli-daso mpiexec --oversubscribe -n 2 $train --algorithm daso --ranks-per-node 1 \
    --daso-warmup-epochs 0 --daso-cooldown-epochs 1 --metrics "$out/logs/daso.jsonl"
run cli-asgd mpiexec --oversubscribe -n 3 $train --algorithm asgd --metrics "$out/logs/asgd.jsonl"
run cli-smega2 mpiexec --oversubscribe -n 3 $train --algorithm smega2 --metrics "$out/logs/smega2.jsonl"
for alg in ssgd smega2 odsgd; do
    run loop-$alg mpiexec --oversubscribe -n 3 python3 examples/train_mnist.py --algorithm $alg \
        --epochs 1 --train-limit 6000
done
for f in "$out"/logs/*.jsonl; do
    [ -f "$f" ] && echo "$(basename "$f"): $(tail -n 1 "$f" | cut -c1-300)" >> "$summary"
done
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
cat "$summary"
