# Sourced by the device-call scripts (s9_call2 onwards; one H200 call each, run from the
# repository root): the checkout made importable as rltlab.kernels / rltlab.engine_patches, the
# GPU's clocks printed, and replay_run for depth_gain runs collected into one JSONL file (the
# device returns at most 8 files).
ln -sfn ../kernels rltlab/kernels; ln -sfn ../engine_patches rltlab/engine_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv

replay_run() {  # name, depth_gain args...: one run at the Ouro-1.4B shape, appended to
                # $OUT/replays.{log,jsonl}; REPLAY_TIMEOUT seconds at most (default 150)
  local name=$1; shift
  timeout "${REPLAY_TIMEOUT:-150}" python3 -m rltlab.bench.depth_gain --preset ouro-1.4b \
    --device cuda --dtype bfloat16 "$@" > /tmp/$name.log 2>&1
  echo "$name rc $?: $(grep '^gain' /tmp/$name.log)"
  { echo "== $name: $*"; cat /tmp/$name.log; } >> $OUT/replays.log
  echo "{\"name\": \"$name\", \"result\": $(tail -1 /tmp/$name.log)}" >> $OUT/replays.jsonl
}

tree_bench() {  # name, timeout, bench args...: python -m rltlab.bench.tree_spec on the engine
                # path (--device cuda), its JSON and log under $OUT, then the log's table
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m rltlab.bench.tree_spec --device cuda --paths engine "$@" \
    --out $OUT/$name.json > $OUT/$name.log 2>&1
  echo "$name rc $?"; grep -vE "^W1204|warn|^ *$" $OUT/$name.log | tail -17 | cut -c1-200
}

tree_profile() {  # prompts, max_tokens, timeout, tree_engine_profile.py args...: one profile,
                  # its log under $OUT, then the log's JSON line (PROFILE_CUT characters)
  local prompts=$1 tokens=$2 limit=$3 log=$OUT/profile_$1x$2.log; shift 3
  timeout $limit python3 docs/experiments/scripts/tree_engine_profile.py --device cuda \
    --prompts $prompts --max-tokens $tokens "$@" > $log 2>&1
  echo "profile $prompts x $tokens rc $?"; tail -1 $log | cut -c1-${PROFILE_CUT:-2500}
}
