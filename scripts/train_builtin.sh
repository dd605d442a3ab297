#!/usr/bin/env bash
# Train treeflash's built-in pair on one GPU from the pre-tokenized corpus made on a CPU
# machine (python -m treeflash.train tokenizer / corpus -> .work/corpus): the target for
# TARGET_MINUTES, then a DFlash drafter per training source for DRAFTER_MINUTES each; every
# trainer reports held-out loss, the drafter also τ through the engine. Run from the repo root.
#
#   OUT=/path/out scripts/train_builtin.sh     # the real run: target 4.5 min, 1 min of generation,
#                                              # drafter 6 min: ~12.5 min in all (two device commands)
#   TARGET=treeflash/builtin/target OUT=... scripts/train_builtin.sh
#                                   # the drafter only, for an existing target (how the shipped one was made)
#   TARGET=... SOURCES="corpus generated" OUT=... scripts/train_builtin.sh   # compare training texts
#   CPU smoke run with tiny shapes: see TRAINING.md.
#
# Training state stays under $WORK, never under $OUT. Each finished checkpoint goes into $OUT
# at once (a later failure loses nothing), as 15 MiB pieces of a tar of its folder:
#   <name>.tar.part-NN, name = target, drafter (drafter-<source> when SOURCES names several);
#   unpack: cat target.tar.part-* | tar -x -C treeflash/builtin   (same for drafter)
# plus train.log, summary.json (all held-out metrics and τ) and <name>_loss.png: at most
# 8 files for a target and one drafter, or for up to three drafters of a given TARGET.
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
DATA=${DATA:-.work/corpus}
WORK=${WORK:-/tmp/treeflash-train}
PY=${PYTHON:-python3}
TARGET=${TARGET:-}                       # an existing target checkpoint: skip target training
TARGET_MINUTES=${TARGET_MINUTES:-4.5}
DRAFTER_MINUTES=${DRAFTER_MINUTES:-6}
DRAFTER_LAYERS=${DRAFTER_LAYERS:-3}
SOURCES=${SOURCES:-generated}            # drafter training text: generated and/or corpus
GEN_PROMPTS=${GEN_PROMPTS:-49152}        # target-generated sequences (64-token prompt + 448 greedy tokens)
TARGET_ARGS=${TARGET_ARGS:-}
DRAFTER_ARGS=${DRAFTER_ARGS:-}
GEN_ARGS=${GEN_ARGS:-}

case "$(realpath -m "$WORK")/" in "$(realpath -m "$OUT")"/*) echo "WORK must not be inside OUT" >&2; exit 2;; esac
mkdir -p "$OUT"
rm -rf "$WORK"/pack "$WORK"/*-run "$WORK"/generated.npz
PACK=$WORK/pack
mkdir -p "$PACK"
exec > >(tee -a "$OUT/train.log") 2>&1
export PYTHONUNBUFFERED=1
T0=$SECONDS
stamp() { echo "=== $(date -u +%H:%M:%S) +$((SECONDS - T0))s: $*"; }

finish() {  # $1: a trained checkpoint in $PACK/$1 and its run in $WORK/$1-run -> $OUT
  tar -C "$PACK" -cf - "$1" | split -b 15M -d -a 2 - "$OUT/$1.tar.part-"
  if [ -f "$WORK/$1-run/loss.png" ]; then cp "$WORK/$1-run/loss.png" "$OUT/$1_loss.png"; fi
  "$PY" - "$WORK" "$OUT/summary.json" <<'EOF'
import json, pathlib, sys
runs = sorted(pathlib.Path(sys.argv[1]).glob("*-run/summary.json"))
summary = {p.parent.name.removesuffix("-run"): json.loads(p.read_text()) for p in runs}
pathlib.Path(sys.argv[2]).write_text(json.dumps(summary, indent=2))
EOF
  stamp "$1 written to $OUT: $(du -sh "$PACK/$1" | cut -f1)"
}

"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
    torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
"$PY" -c 'import json,sys; m=json.load(open(sys.argv[1])); print("corpus:", {k: m[k] for k in
    ("train_files","train_tokens","heldout_tokens","vocab_size","bytes_per_token")})' "$DATA/corpus.json"

if [ -z "$TARGET" ]; then
  stamp "target: ${TARGET_MINUTES} min"
  TARGET=$PACK/target
  # shellcheck disable=SC2086
  "$PY" -m treeflash.train target --data "$DATA" --run "$WORK/target-run" --out "$TARGET" \
    --max-minutes "$TARGET_MINUTES" --batch-size 64 --seq-len 1024 --lr 2e-3 --warmup-steps 200 \
    --eval-every 500 --eval-tokens 400000 --save-every 1000 --log-every 100 $TARGET_ARGS
  finish target
fi

n_sources=$(echo $SOURCES | wc -w)
for source in $SOURCES; do
  name=drafter
  if [ "$n_sources" -gt 1 ]; then name=drafter-$source; fi
  data_args=()
  if [ "$source" = generated ]; then
    stamp "generating $GEN_PROMPTS continuations with the target"
    # shellcheck disable=SC2086
    "$PY" -m treeflash.train generate --target "$TARGET" --data "$DATA" --out "$WORK/generated.npz" \
      --num-prompts "$GEN_PROMPTS" --prompt-len 64 --new-tokens 448 --batch-size 4096 $GEN_ARGS
    data_args=(--generated "$WORK/generated.npz")
  elif [ "$source" != corpus ]; then
    echo "unknown source '$source' (choose corpus or generated)" >&2; exit 2
  fi
  stamp "$name: ${DRAFTER_MINUTES} min on $source text"
  # shellcheck disable=SC2086
  "$PY" -m treeflash.train drafter --target "$TARGET" --data "$DATA" "${data_args[@]}" \
    --run "$WORK/$name-run" --out "$PACK/$name" --max-minutes "$DRAFTER_MINUTES" \
    --num-layers "$DRAFTER_LAYERS" --block-size 16 --target-layer-ids 1,3,5 --batch-size 64 --seq-len 512 \
    --blocks-per-seq 32 --lr 2e-3 --warmup-steps 100 --eval-every 1000 --eval-tokens 262144 \
    --save-every 2000 --log-every 500 --tau-prompts 32 --tau-new-tokens 256 $DRAFTER_ARGS
  finish "$name"
done
cat "$OUT/summary.json"
ls -la "$OUT"
stamp "done"
