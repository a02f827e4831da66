#!/bin/bash
# For the sixteenth session's sixth device call (H200): the several-row kernels' tests compiled
# for the GPU (TRITON_INTERPRET=0; the test files default to the interpreter), including bf16
# rows through tl.dot in 16-row blocks, which only a GPU runs faithfully.
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_small_batch.py tests/test_kernels_rope_gemv.py > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc $?"; grep -E "passed|failed|skipped|^FAILED" $OUT/kernel_tests.log | tail -15
