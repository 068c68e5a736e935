#!/usr/bin/env bash
# The Fashion-MNIST measurements quoted in README.md and docs/design/fashion_mnist_experiments.md, one run after another.
#
#   bash benchmarks/fashion_mnist.sh OUT_DIR [NAME ...]   # all runs, or only the named ones
#   python benchmarks/summarize.py OUT_DIR                # the table
#
# Needs the prepared dataset (python tools/prepare_fashion_mnist.py). What each run writes,
# and how a stopped script resumes: benchmarks/runs.sh.
set -euo pipefail
# shellcheck source=benchmarks/runs.sh
. "$(dirname "$0")/runs.sh"
start_runs "${1:?usage: bash benchmarks/fashion_mnist.sh OUT_DIR [NAME ...]}" "${@:2}"

# The spine config (Tramer & Boneh's CNN at epsilon = 3).
run main --gin_file=fashion_mnist.gin
# ScatterNet models (Tramer & Boneh Table 13 settings).
run scatternet_linear --gin_file=fashion_mnist_scatternet_linear.gin
run scatternet_cnn --gin_file=fashion_mnist_scatternet_cnn.gin
# The recipe on ScatterNet + linear, then the ablation on the CNN:
# augmult K x EMA (both evaluated in every run), 4 accumulation chunks.
run recipe --gin_file=fashion_mnist_recipe.gin
# One more seed of the recipe and of its no-recipe twin, for their run-to-run noise.
run recipe_seed1 --gin_file=fashion_mnist_recipe.gin --gin_param=tfdp.RuntimeConfig.seed=1
run scatternet_linear_seed1 --gin_file=fashion_mnist_scatternet_linear.gin \
  --gin_param=tfdp.RuntimeConfig.seed=1
run recipe_k0 --gin_file=fashion_mnist_recipe_cnn.gin --gin_param=AUGMULT=0 \
  --gin_param=tfdp.AugmentationConfig.augtest=False
run recipe_k0_accum4 --gin_file=fashion_mnist_recipe_cnn.gin --gin_param=AUGMULT=0 \
  --gin_param=tfdp.AugmentationConfig.augtest=False \
  --gin_param=tfdp.OptimizationConfig.accumulation_steps=4
# Run-to-run noise of the two K = 0 runs above: two more seeds each (sampling, init and
# a fresh noise draw), so "4 chunks matches 1 step" is judged against their spread.
for seed in 1 2; do
  run recipe_k0_seed$seed --gin_file=fashion_mnist_recipe_cnn.gin --gin_param=AUGMULT=0 \
    --gin_param=tfdp.AugmentationConfig.augtest=False --gin_param=tfdp.RuntimeConfig.seed=$seed
  run recipe_k0_accum4_seed$seed --gin_file=fashion_mnist_recipe_cnn.gin --gin_param=AUGMULT=0 \
    --gin_param=tfdp.AugmentationConfig.augtest=False --gin_param=tfdp.RuntimeConfig.seed=$seed \
    --gin_param=tfdp.OptimizationConfig.accumulation_steps=4
done
run recipe_k4 --gin_file=fashion_mnist_recipe_cnn.gin --gin_param=AUGMULT=4
run recipe_k8 --gin_file=fashion_mnist_recipe_cnn.gin --gin_param=AUGMULT=8
# TAN simulations of the main run (B_ref = 2048) at B/8, B/4, B/2, same steps.
for b in 256 512 1024; do
  name=tan_sim_b$b
  if ! wanted_run "$name"; then continue; fi
  sigma=$(python -c "import json; print(json.load(open('$out/main/privacy_report.json'))['noise_multiplier'])")
  mapfile -t params < <(python tools/privacy.py simulate --num_examples 60000 \
    --reference_batch_size 2048 --reference_noise_multiplier "$sigma" --steps 1172 \
    --batch_size "$b" --delta 1e-5 --json | tail -n 1 |
    python -c "import json, sys; print('\n'.join(json.load(sys.stdin)['gin_params']))")
  run "$name" --gin_file=fashion_mnist.gin "${params[@]}"
done
# The two-stage job. Public pretraining (NOT PRIVATE) on the first 2,000 training
# examples, then private fine-tuning at (3, 1e-5) on the other 58,000, of all layers and of
# the head alone (features computed once), 3 seeds each; beside 3 seeds of fashion_mnist.gin
# from scratch (60,000 examples) at the same epsilon.
run public_pretrain --gin_file=fashion_mnist_public_pretrain.gin
for mode in all head; do
  for seed in 0 1 2; do
    name=finetune_$mode$([ $seed = 0 ] || echo _seed$seed)
    run "$name" --gin_file=fashion_mnist_finetune.gin \
      --gin_param="PRETRAINED_BACKBONE='$out/public_pretrain'" --gin_param="TRAINABLE='$mode'" \
      --gin_param=tfdp.RuntimeConfig.seed=$seed
  done
done
for seed in 1 2; do
  run main_seed$seed --gin_file=fashion_mnist.gin --gin_param=tfdp.RuntimeConfig.seed=$seed
done
# The best config (chosen by benchmarks/fashion_mnist_search.sh on the validation
# split), 3 seeds on all 60,000 training examples, each scored once on the test set. The
# table's accuracy is the export's: python tools/score_export.py OUT_DIR/best_seed$seed/export
for seed in 0 1 2; do
  run best_seed$seed --gin_file=fashion_mnist_best.gin --gin_param=tfdp.RuntimeConfig.seed=$seed
done
