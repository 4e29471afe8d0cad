#!/bin/bash
# Multi-node pretraining with SLURM + torchrun: one torchrun per node, 8 GPUs per node.
# moefold train sees torchrun's RANK/WORLD_SIZE/MASTER_ADDR and uses the launcher's ranks (NCCL on GPUs).
#
#   sbatch examples/slurm.sh                      # 2 nodes x 8 GPUs, DeepSeek-V3 proxy, EP 8 x TP 2
#
#SBATCH --job-name=moefold
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --signal=TERM@120        # SIGTERM to the job step 120 s before the time limit: every rank finishes its
#SBATCH --requeue                # step and saves (exit 143); the requeued job resumes with --load (same --save)

set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
RUN=${RUN:-runs/deepseek_v3_proxy}

srun torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node 8 \
    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    -m moefold.training.cli train \
    --recipe deepseek_v3_proxy \
    --tensor-model-parallel-size 2 --sequence-parallel \
    --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 \
    --micro-batch-size 1 --global-batch-size 64 --seq-length 4096 \
    --train-iters 1000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 --bf16 \
    --moe-token-dispatcher-type alltoall \
    --data-path 0.7 data/web_text 0.3 data/code \
    --vocab-size 129280 \
    --save "$RUN/checkpoints" --save-interval 200 --load "$RUN/checkpoints" --async-save \
    --run-dir "$RUN" --log-interval 10
