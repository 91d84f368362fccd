#!/usr/bin/env bash
# Train the demo target's EAGLE-3 head on a lent GPU box (jax with CUDA there; no llama.cpp, no
# network), with `edgespec models train-head --features jax`: the target runs in jax
# (edgespec/heads/target_jax.py) to answer the prompts and give the features, then the same trainer.
#
# The box is reached through calls whose working tree is at most 64 MiB, so the target travels as
# the demo's source GGUF (SmolLM2-135M-Instruct.Q4_1, 94 MiB: its weights dequantized ARE the F32
# target's, bit for bit) in two parts, one a call, staged in /tmp while the box stays warm:
#   here:   tools/gpu-train-head.sh prep           -> .gpu-carry/{wheels,work,p1,p2} (git-excluded)
#           (move edgespec/data/heads/*.gguf out of the tree for the two calls: 17 MiB)
#   call 1: carry [".gpu-carry/p1", ".gpu-carry/wheels", ".gpu-carry/work"], command
#           "tools/gpu-train-head.sh stage"        (environment check, part 1 to /tmp)
#   call 2: carry [".gpu-carry/p2"], command "tools/gpu-train-head.sh train", timeout_s 600
#           -> $OUT/head.gguf, report.json, heldout.json, train.log
#   here:   edgespec models eval-head HEAD --work-dir DIR-WITH-report.json-AND-heldout.json
#           (held-out acceptance through llama.cpp on the real F32 target, then the card)
# env: HEAD_ARGS (extra train-head options), HEAD_TIMEOUT_S (570)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CARRY="$ROOT/.gpu-carry"
STAGE=/tmp/edgespec-target
SITE=/tmp/edgespec-site
OUT=${OUT:-/tmp/gpu-head-out}
SOURCE_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# the shipped head's sizes (the card's command)
DISTILL=12000
HELDOUT=48
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20

case "${1:-}" in
prep)
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  EXCLUDE=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$EXCLUDE")" "$CARRY/wheels" "$CARRY/work" "$CARRY/p1" "$CARRY/p2"
  grep -qxF '/.gpu-carry/' "$EXCLUDE" 2>/dev/null || echo '/.gpu-carry/' >> "$EXCLUDE"
  "$PY" -m pip download -q --no-deps --only-binary :all: -d "$CARRY/wheels" gguf==0.19.0
  SRC=$("$PY" -c "from edgespec.config import models_dir; print(models_dir() / '.source' / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
  echo "$SOURCE_SHA256  $SRC" | sha256sum -c -
  split -n 2 -d "$SRC" "$CARRY/q41.part"
  mv "$CARRY/q41.part00" "$CARRY/p1/"; mv "$CARRY/q41.part01" "$CARRY/p2/"
  "$PY" - "$CARRY/work" "$DISTILL" "$HELDOUT" <<'PY'
import sys
from pathlib import Path
from edgespec.heads.target_jax import prompt_tokens
from edgespec.heads.train import TrainSpec
from edgespec.models import default_pair
spec = TrainSpec(target=default_pair().target, out=Path("unused.gguf"), work_dir=Path(sys.argv[1]),
                 distill_prompts=int(sys.argv[2]), heldout_prompts=int(sys.argv[3]))
prompt_tokens(spec, print)
PY
  du -sh "$CARRY"/* >&2
  ;;
stage)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import jax, numpy; print('jax', jax.__version__, jax.devices(), 'numpy', numpy.__version__)"
  mkdir -p "$STAGE"
  cp "$CARRY"/p1/q41.part* "$STAGE/"
  rm -rf "$SITE" && python3 -m pip install -q --no-index --no-deps --target "$SITE" "$CARRY"/wheels/*.whl
  mkdir -p /tmp/edgespec-head-work && cp -r "$CARRY/work/." /tmp/edgespec-head-work/
  PYTHONPATH="$ROOT:$SITE" python3 -c "import gguf, typer, tqdm; import edgespec.heads.target_jax, edgespec.heads.train; print('imports ok')"
  ls -la "$STAGE" /tmp/edgespec-head-work/data
  ;;
train)
  cp "$CARRY"/p2/q41.part* "$STAGE/"
  cat "$STAGE"/q41.part* > "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf"
  echo "$SOURCE_SHA256  $STAGE/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
  mkdir -p "$OUT"
  set +e
  # shellcheck disable=SC2086
  PYTHONPATH="$ROOT:$SITE" timeout "${HEAD_TIMEOUT_S:-570}" python3 -c "from edgespec.cli.main import app; app()" \
    models train-head "$OUT/head.gguf" --target "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf" \
    --work-dir /tmp/edgespec-head-work --features jax --distill-prompts "$DISTILL" --heldout-prompts "$HELDOUT" \
    --max-new 160 --streams 1024 --sampled 2 --data-minutes 3.5 --minutes 3 --draft-vocab 4096 --window 256 \
    --batch 64 --lr 2e-3 --eval-s 20 --seed 0 --precision f32 ${HEAD_ARGS:-} 2>&1 | tee "$OUT/train.log"
  rc=${PIPESTATUS[0]}
  set -e
  cp /tmp/edgespec-head-work/report.json /tmp/edgespec-head-work/heldout.json "$OUT/" 2>/dev/null || true
  ls -la "$OUT"
  exit "$rc"
  ;;
*)
  echo "usage: $0 prep|stage|train" >&2
  exit 2
  ;;
esac
