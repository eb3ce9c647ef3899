#!/usr/bin/env bash
# The embedded demo: 1,797 bundled 8x8 digits -> LMDBs -> mean -> train LeNet -> test.
#
#   bash examples/digits/run.sh            # one process
#   bash examples/digits/run.sh --mpi 2    # two MPI ranks (mpiexec -n 2 caffepy train ...)
#
# Needs `caffepy` on PATH (`make demo` puts the venv's bin first). Everything it
# writes goes to examples/digits/work/ (git-ignored), rebuilt on every run.
set -euo pipefail

RANKS=1
if [[ "${1:-}" == "--mpi" ]]; then
  RANKS="${2:?usage: run.sh [--mpi N]}"
fi

cd "$(dirname "$0")/../.."
DIGITS=examples/digits
WORK=$DIGITS/work
START=$SECONDS

rm -rf "$WORK"
mkdir -p "$WORK"

# 8x8 grayscale PNGs, upscaled (INTER_LINEAR) to the net's 16x16
caffepy convert_imageset --gray --resize_height 16 --resize_width 16 \
  $DIGITS/images/ $DIGITS/train.txt $WORK/digits_train_lmdb
caffepy convert_imageset --gray --resize_height 16 --resize_width 16 \
  $DIGITS/images/ $DIGITS/test.txt $WORK/digits_test_lmdb
caffepy compute_image_mean $WORK/digits_train_lmdb $WORK/digits_mean.binaryproto

if [[ "$RANKS" -gt 1 ]]; then
  mpiexec -n "$RANKS" caffepy train --solver $DIGITS/lenet_solver.prototxt 2>&1 | tee $WORK/train.log
else
  caffepy train --solver $DIGITS/lenet_solver.prototxt 2>&1 | tee $WORK/train.log
fi

# the final snapshot: <snapshot_prefix>_iter_<max_iter>.caffemodel
MAX_ITER=$(sed -n 's/^max_iter: *\([0-9]*\).*/\1/p' $DIGITS/lenet_solver.prototxt)
WEIGHTS=$WORK/lenet_iter_${MAX_ITER}.caffemodel

# 4 batches of 74 = the 296 test digits, each once
caffepy test --model $DIGITS/lenet_train_test.prototxt --weights "$WEIGHTS" --iterations 4 \
  2>&1 | tee $WORK/test.log

ACCURACY=$(grep -o 'accuracy = [0-9.]*' $WORK/test.log | tail -1 | awk '{print $3}')
echo "Digits demo: test accuracy ${ACCURACY} on 296 held-out digits ($((SECONDS - START)) s in all)"
