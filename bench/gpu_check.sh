#!/usr/bin/env bash
# GPU checks of the trainer, one verdict line each (PASS/FAIL/SKIP name: detail), in a few
# minutes on one GPU; exit code 1 if any check FAILs. See bench/gpu_check.py for the list.
#
#   bash bench/gpu_check.sh                   # on a GPU host
#   docker run --rm --gpus all --ipc=host IMAGE bash bench/gpu_check.sh
#   bash bench/gpu_check.sh --allow-cpu       # no GPU: CPU-capable checks, CUDA-only ones SKIP
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --only native
#
# It first checks that the pinned runtime requirements import; only if they don't does it try
# `pip install -r requirements.txt` (the host may have no network: then it prints FAIL setup).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

export NO_ALBUMENTATIONS_UPDATE=1 PYTHONUNBUFFERED=1
if [[ -z ${PYTHON:-} ]]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
started=$SECONDS

fail_setup() {
  echo "FAIL setup: $*"
  echo "gpu_check: setup failed; elapsed $((SECONDS - started)) s"
  exit 1
}

imports() {  # exit 3: no torch; exit 4: a runtime requirement is missing (printed)
  "$PYTHON" -c '
import sys
try:
    import torch
except ImportError:
    sys.exit(3)
try:
    import albumentations, monai, nibabel
except ImportError as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(4)
' 2>&1
}

missing=$(imports)
case $? in
  0) ;;
  3) fail_setup "torch does not import with PYTHON=$PYTHON (set PYTHON to the interpreter that has it)" ;;
  4)
    echo "setup: runtime requirements missing ($(tail -n 1 <<<"$missing")); pip install -r requirements.txt"
    [[ -f requirements.txt ]] \
      || fail_setup "monai/albumentations/nibabel do not import and requirements.txt is not here ($PWD)"
    if ! pip_log=$("$PYTHON" -m pip install --quiet --disable-pip-version-check --retries 1 \
        --timeout 15 -r requirements.txt 2>&1); then
      fail_setup "pip install -r requirements.txt failed (no network?): $(tail -n 1 <<<"$pip_log")"
    fi
    missing=$(imports) \
      || fail_setup "monai/albumentations/nibabel still do not import after pip install: $(tail -n 1 <<<"$missing")"
    echo "setup: installed requirements.txt in $((SECONDS - started)) s"
    ;;
  *) fail_setup "checking the imports failed: $(tail -n 1 <<<"$missing")" ;;
esac

"$PYTHON" bench/gpu_check.py "$@"
