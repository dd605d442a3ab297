#!/usr/bin/env bash
# The device suite (`pytest -m gpu tests`) one file at a time under a time budget, so that a
# call cut short still says which files passed. The kernel tests come first (tree attention
# against SDPA, the tree build, the walk, the fused ops, FP8, MoE, gpt-oss), then the graphed
# engine, server and TP tests, then any other file's (tests/*.py less those named: "rest").
# From the repo root, on a machine with a CUDA GPU:
#
#   OUT=/path/out BUDGET=540 bash scripts/gpu_suite.sh
#
# $OUT gets one log per file; the output is one line per file (exit status, seconds, pytest's
# summary), then the failures. A file that the budget leaves no time for says "not run". The
# exit status is that of the first failing file, else 124 if a file was not run.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
rm -f "$OUT"/*.log  # an earlier run's failures are not this one's
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-540}
WORKERS=${WORKERS:-12}
FILES=(test_kernels test_tree_build_kernel test_walk_kernel test_fused_ops test_fp8 test_moe test_gpt_oss_kernels
       test_gpu test_gpt_oss test_pipeline test_server test_tp test_tp_gpu test_all_reduce_gpu)
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
for f in "${FILES[@]}" rest; do
    left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "$f: not run (budget)"
        if [ "$status" -eq 0 ]; then status=124; fi
        continue
    fi
    if [ "$f" = rest ]; then
        targets=(tests "${FILES[@]/#/--ignore=tests/}")
        targets=("${targets[@]/%/.py}")
        targets[0]=tests
    else
        targets=("tests/$f.py")
    fi
    t0=$SECONDS
    timeout "$left" $PY -m pytest -q -n "$WORKERS" -m gpu -p no:cacheprovider --tb=short "${targets[@]}" \
        > "$OUT/$f.log" 2>&1
    rc=$?
    echo "$f: exit $rc, $((SECONDS - t0)) s: $(tail -n 1 "$OUT/$f.log")"
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && [ "$status" -eq 0 ]; then status=$rc; fi  # 5: none selected
done
grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log 2>/dev/null | head -n 40
exit "$status"
