#!/usr/bin/env bash
# Issue 22's accelerator figures in one run on a lent GPU machine (after ../shared/gpu/README.md's
# setup), the stages named in $STAGES, in that order (default: dump dump_warm index eval
# step_bf16 step_bf16_nodrop step_bf16_nodrop_cudnn):
#   dump        the SQuAD-open small dump (every token of the 20,958 train + dev paragraphs, the
#               accelerator recipe's settings: experiments/squad.py); a fresh machine, so every
#               executable compiles (no persistent compilation cache yet)
#   dump_warm   the same dump again into another folder: its executables from that cache
#   dump_wM     the dump at call widths rounded to multiples of M (index.dump_width_multiple:
#               128 in experiments/squad.py, 0 = the accelerator's 32), with a compilation cache
#               of its own
#   index, eval its Flat index; the open-domain eval of all 10,570 dev questions (`run.py eval`:
#               top-10 phrases + passage Top-k from one index search)
#   step_bf16, step_bf16_nodrop, step_bf16_nodrop_cudnn
#               the bf16 train step at batch 48 x 384 (experiments/benchmarks/train_step.py):
#               with dropout as the recipe trains; without; without, on cuDNN attention.
#               Every step stage times the loop's own step (the state's flat leaves,
#               `Trainer.advance`), the time each call took to return (host_step_s), and 20
#               steps on the state as a pytree as before (`--pytree`: pytree_step_s)
#   step_bf16_pallas  the same with dropout, on the Pallas flash-attention kernel
#               (DPJAX_ATTENTION=pallas: the masks of the XLA path, made inside the kernel)
#   step_bf16_pallas_best  the same at the `attention` stage's fastest setting
#               (DPJAX_FLASH_TUNING; its default settings if that stage did not run)
#   step_bf16_profile, step_bf16_pallas_profile
#               the bf16 step with dropout on XLA's attention / on the kernel at that setting,
#               with --steps more traced: per step, the device's busy and idle ms and its time
#               by operation and kind (experiments/benchmarks/profile_summary.py; the JSON
#               line in the stage's log; the traces stay in WORKDIR)
#   flash_tests tests/test_flash_attention.py compiled for the GPU (float32 products exact;
#               needs pytest on the machine)
#   attention   one layer's attention, forward + backward, at the step's shapes: the flash
#               kernel's launch settings against XLA's materialised softmax and cuDNN
#               (experiments/benchmarks/attention.py)
# Each stage's wall time and the dumps' manifests go to OUT/gpu_speed.json (written after every
# stage; every stage has a time limit, so that the whole fits one 10-minute device command:
# T_DUMP, T_INDEX, T_EVAL, T_STEP (each step_* stage), T_ATTENTION, T_FLASH_TESTS seconds).
# Timing only: the encoders are MiniLM as loaded (eval.allow_untrained), since what the dump,
# search and step compute does not depend on the weights; the eval's EM is not a result here.
# Usage: PY=python3 SET="--set data.dir=/root/gpu/data/squad" [STAGES="dump eval"] \
#          bash experiments/benchmarks/gpu_speed.sh WORKDIR OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${1:?usage: gpu_speed.sh WORKDIR OUT}
OUT=${2:?usage: gpu_speed.sh WORKDIR OUT}
PY=${PY:-python3}
CONFIG=${CONFIG:-experiments/squad.py}
mkdir -p "$W" "$OUT"
# shellcheck disable=SC2086  # SET: --set arguments, word-split on purpose
C=(--config "$CONFIG" --workdir "$W" --set eval.allow_untrained=True --set train.progress_bar=False
   ${SET:-})
T=${T_DUMP:-160},${T_INDEX:-40},${T_EVAL:-170},${T_STEP:-85}
IFS=, read -r t_dump t_index t_eval t_step <<< "$T"
STAGES=${STAGES:-dump dump_warm index eval step_bf16 step_bf16_nodrop step_bf16_nodrop_cudnn}
declare -A WALL RC

stage() {  # stage NAME LIMIT_S COMMAND...: runs it under a time limit, log to OUT/NAME.log
  local name=$1 limit=$2 start
  shift 2
  echo "=== $(date -Is) $name (limit ${limit}s): $*"
  start=$(date +%s.%N)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  RC[$name]=$?
  WALL[$name]=$(awk "BEGIN{print $(date +%s.%N) - $start}")
  tail -n 4 "$OUT/$name.log"
  echo "=== $name: rc ${RC[$name]}, ${WALL[$name]} s"
  summary
}

summary() {
  local walls="" k
  for k in "${!WALL[@]}"; do walls+="$k=${WALL[$k]}:${RC[$k]} "; done
  "$PY" - "$W" "$OUT" "$walls" <<'EOF'
import json, pathlib, sys
w, out, walls = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3].split()
s = {"stages": {k: {"wall_s": float(v.split(":")[0]), "rc": int(v.split(":")[1])}
                for k, v in (x.split("=") for x in walls)}}
try:
  import jax
  s["device"] = str(jax.devices()[0].device_kind)
except Exception as e:  # the summary is written whatever broke
  s["device"] = repr(e)
# the eval's rescoring runs in faiss's thread count only with threadpoolctl (else in one)
for key, module, value in (("faiss_threads", "faiss", lambda m: m.omp_get_max_threads()),
                           ("threadpoolctl", "threadpoolctl", bool)):
  try:
    s[key] = value(__import__(module))
  except ImportError as e:
    s[key] = repr(e)
for m in sorted(w.glob("*/manifest.json")):
  name = {"warm": "dump_warm"}.get(m.parent.name, m.parent.name)
  d = json.loads(m.read_text())
  if d.get("complete"):
    s[name] = {k: d.get(k) for k in ("num_passages", "num_tokens", "seconds", "compile_seconds",
                                     "compiles", "host_seconds", "encoder_wait_seconds",
                                     "pipeline_wait_seconds", "host_cpu_seconds",
                                     "dispatch_seconds", "fetch_seconds", "processes", "settings",
                                     "compile_ahead_seconds", "compile_ahead_shapes",
                                     "width_multiple")}
    s[name]["stored_tokens_per_s"] = d["num_tokens"] / d["seconds"]
    s[name]["host_us_per_token"] = 1e6 * d["host_seconds"] / d["num_tokens"]
for e in sorted(w.glob("open_eval_*.json")):
  d = json.loads(e.read_text())
  d = d.get("report", d)
  s[e.stem] = {k: d.get(k) for k in ("questions", "search_seconds", "questions_per_sec_batch64",
                                     "index_tokens", "index_build_seconds", "em@1", "top20")}
if (out / "attention.json").is_file():  # experiments/benchmarks/attention.py's own JSON
  s["attention"] = json.loads((out / "attention.json").read_text())
for f in sorted(out.glob("step_*.log")):  # train_step.py's last stdout line is its JSON
  lines = [x for x in f.read_text().splitlines() if x.startswith("{")]
  if lines:
    s[f.stem] = json.loads(lines[-1])
(out / "gpu_speed.json").write_text(json.dumps(s, indent=1))
EOF
}

echo "=== $(date -Is) $(git rev-parse --short HEAD 2>/dev/null) $CONFIG stages: $STAGES"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
step() {  # step NAME [train_step.py args] (env: DPJAX_ATTENTION)
  local name=$1
  shift
  stage "$name" "$t_step" "$PY" experiments/benchmarks/train_step.py --framework jax --batch 48 \
    --dtype bfloat16 --steps 20 --warmup 3 --pytree "$@"
}
flash_best() {  # the attention stage's fastest flash setting ("": the kernel's defaults)
  local best
  best=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["best"] or "")' \
         "$OUT/attention.json" 2>/dev/null)
  echo "=== attention's best setting: ${best:-none}" >&2
  echo "$best"
}
for s in $STAGES; do
  case $s in
    dump) stage dump "$t_dump" "$PY" run.py dump "${C[@]}" ;;
    # the same dump again in a new folder: its executables from the persistent compilation cache
    dump_warm) stage dump_warm "$t_dump" "$PY" run.py dump "${C[@]}" --set index.dump_name=warm ;;
    # dump_wM: the dump at width multiple M, with a compilation cache of its own (cold)
    dump_w*) DPJAX_COMPILATION_CACHE=$W/xla_${s#dump_w} stage "$s" "$t_dump" "$PY" run.py dump \
               "${C[@]}" --set "index.dump_width_multiple=${s#dump_w}" --set "index.dump_name=$s" ;;
    index) stage index "$t_index" "$PY" run.py index "${C[@]}" --set 'index.specs=["Flat"]' ;;
    eval) stage eval "$t_eval" "$PY" run.py eval "${C[@]}" --set index.search_index=Flat ;;
    step_bf16) step step_bf16 ;;
    step_bf16_nodrop) step step_bf16_nodrop --no-dropout ;;
    step_bf16_nodrop_cudnn) DPJAX_ATTENTION=cudnn step step_bf16_nodrop_cudnn --no-dropout ;;
    # the Pallas flash-attention kernel (dpjax/models/flash_attention.py), with dropout
    step_bf16_pallas) DPJAX_ATTENTION=pallas step step_bf16_pallas ;;
    # the same with the attention stage's fastest setting (after `attention`)
    step_bf16_pallas_best)
      DPJAX_ATTENTION=pallas DPJAX_FLASH_TUNING=$(flash_best) step step_bf16_pallas_best ;;
    # the step with dropout, traced: where its device time goes (profile_summary.py), on XLA's
    # attention and on the kernel at the attention stage's best setting
    step_bf16_profile) step step_bf16_profile --profile "$W/trace_xla" ;;
    step_bf16_pallas_profile) DPJAX_ATTENTION=pallas DPJAX_FLASH_TUNING=$(flash_best) \
                                step step_bf16_pallas_profile --profile "$W/trace_pallas" ;;
    # attention alone, forward + backward: flash settings against XLA's materialised softmax
    attention) stage attention "${T_ATTENTION:-150}" "$PY" experiments/benchmarks/attention.py \
                 --out "$OUT/attention.json" ;;
    # its tests compiled for the GPU (not Pallas' interpreter), float32 products exact
    flash_tests) JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest stage flash_tests \
                   "${T_FLASH_TESTS:-150}" "$PY" -m pytest -q -p no:cacheprovider tests/test_flash_attention.py ;;
    *) echo "gpu_speed.sh: unknown stage $s" >&2; exit 2 ;;
  esac
done
cat "$OUT/gpu_speed.json"
