#!/usr/bin/env bash
# The regression set (docs/benchmarks.md, "The redesign"): Step 1, decoding, Step 3 at HH lengths with the defaults a
# user gets (each tree's own: old log-probs from the actor step since 99ac820, from scoring before) and fixed (256 + 256
# at batch 256 and 768 over the engine's default 256 decode slots, old log-probs from generation as e977f8f measured
# them: batch 768 decodes in three waves; one slot per prompt, as e977f8f decoded, is --slots 768 and needs ~92 GiB,
# an H200).
# usage: bash tools/bench_regress.sh TREE TAG [PARTS]  (TREE: a checkout of the commit to measure, e.g. a git worktree;
# PARTS: some of "sft gen ppo-len ppo-fixed", all by default, for an A/B that must fit a device session;
# each part's whole log in $OUT/TAG/PART.log; .assets/hh_lengths.json: ../shared/assets/data/hh-rlhf/hh_lengths.json,
# copied and carried to the GPU)
cd "$1"; mkdir -p $OUT/$2
export PYTHONPATH=. XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONUNBUFFERED=1 JAXRLHF_COMMIT=$2
L=$OLDPWD/.assets/hh_lengths.json
PARTS=" ${3:-sft gen ppo-len ppo-fixed} "
t0=$SECONDS
if [[ $PARTS == *" sft "* ]]; then
python tools/bench_sft.py --model opt-1.3b --batch 8 --seq 512 --recipes pure_bf16 --remat 0 --no-hf --repeats 10 --out $OUT/$2 2>&1 | tee $OUT/$2/sft.log | tail -4; echo "sft $((SECONDS-t0)) s"
fi
if [[ $PARTS == *" gen "* ]]; then
python tools/bench_generate.py --batch 64 256 --decode pallas --hf --repeats 3 --out $OUT/$2 2>&1 | tee $OUT/$2/gen.log | tail -4; echo "gen $((SECONDS-t0)) s"
fi
if [[ $PARTS == *" ppo-len "* ]]; then
python tools/bench_ppo.py --batch 768 --slots 256 --precision pure_bf16 --repeats 2 --lengths $L --no-torch --out $OUT/$2 2>&1 | tee $OUT/$2/ppo-len.log | tail -4; echo "ppo-len $((SECONDS-t0)) s"
fi
if [[ $PARTS == *" ppo-fixed "* ]]; then
python tools/bench_ppo.py --batch 256 768 --precision pure_bf16 --old-from-generation --repeats 2 --no-torch --out $OUT/$2 2>&1 | tee $OUT/$2/ppo-fixed.log | tail -4; echo "ppo-fixed $((SECONDS-t0)) s"
fi
