#!/usr/bin/env bash
# Issue 9 on a machine with 2 GPUs (NCCL, CUDA graphs), from the repo root; ~5 min on 2 H200,
# at most ~10 min (the steps are time-limited: 360 s for the tests, 80 s per bench run):
#
#   OUT=/path/out bash scripts/multi_gpu.sh
#
# 1. tests/test_tp_gpu.py: LLM(tp=2) token-identical to tp=1 with graphs on and off; a killed
#    worker is reported in one line. tests/test_all_reduce_gpu.py: the peer all-reduce.
# 2. treeflash bench --shape qwen3-8b (random weights) at C=4096, N in 0,63,255: --tp 1 and
#    --tp 2 with CUDA graphs, --tp 2 without; then a side-by-side table.
#
# $OUT gets 7 files: tp_gpu_tests.log, shape_tp1.{jsonl,log}, shape_tp2.{jsonl,log},
# shape_tp2_eager.{jsonl,log}. A failing step does not stop the later ones; the exit
# status is that of the first failure.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# NVLink multicast stays off (the engine and the bench also default to this)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
status=0

step() {  # step NAME LIMIT_S LOG COMMAND...: run with a time limit, keep the first failure's code
    local name=$1 limit=$2 log=$3
    shift 3
    local t0=$SECONDS
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    echo "== $name: exit $rc, $((SECONDS - t0)) s"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -n 4
$PY -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| nccl',
torch.cuda.nccl.version() if torch.cuda.is_available() else None, '|', torch.cuda.device_count(), 'GPUs')"

echo "== tests/test_tp_gpu.py"
step tests 360 "$OUT/tp_gpu_tests.log" $PY -m pytest -q -rfEs --durations=6 tests/test_tp_gpu.py tests/test_all_reduce_gpu.py
tail -n 25 "$OUT/tp_gpu_tests.log"

BENCH=(-m treeflash bench --shape qwen3-8b --contexts 4096 --budgets 0,63,255 --iters 20)
for run in "tp1:--tp 1" "tp2:--tp 2" "tp2_eager:--tp 2 --graphs off"; do
    name=shape_${run%%:*}
    echo "== bench ${run#*:}"
    # shellcheck disable=SC2086  # the options word-split on purpose
    step "$name" 80 "$OUT/$name.log" $PY "${BENCH[@]}" ${run#*:} --out "$OUT/$name.jsonl"
    grep -v '^  C=' "$OUT/$name.log" | tail -n 20
done

echo "== summary (time us; ratio: to the rank's memory floor; allred: one hidden all-reduce, and its estimated share)"
$PY - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path


def rows(name):
    path = Path(sys.argv[1]) / f"{name}.jsonl"
    if not path.exists():
        return {}
    return {(r["op"], r["N"]): r for r in map(json.loads, path.read_text().splitlines())}


tp1, tp2, eager = rows("shape_tp1"), rows("shape_tp2"), rows("shape_tp2_eager")


def cell(table, key, field, fmt):
    value = table.get(key, {}).get(field)
    return "-" if value is None else fmt.format(value)


head = ["op", "N", "tp1", "tp1 ratio", "tp2", "tp2 ratio", "tp1/tp2", "allred us", "allred", "tp2 eager"]
lines = [head]
for key in dict.fromkeys(list(tp1) + list(tp2) + list(eager)):
    a, b = tp1.get(key, {}).get("time_us"), tp2.get(key, {}).get("time_us")
    lines.append([key[0], str(key[1]), cell(tp1, key, "time_us", "{:.1f}"), cell(tp1, key, "ratio", "{:.2f}"),
                  cell(tp2, key, "time_us", "{:.1f}"), cell(tp2, key, "ratio", "{:.2f}"),
                  f"{a / b:.2f}" if a and b else "-", cell(tp2, key, "allreduce_us", "{:.1f}"),
                  cell(tp2, key, "allreduce_share", "{:.0%}"), cell(eager, key, "time_us", "{:.1f}")])
widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
for line in lines:
    print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths))))
EOF
exit "$status"
