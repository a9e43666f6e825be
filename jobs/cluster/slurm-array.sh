#!/bin/bash
# A SLURM job array over eaglebatch shards: task i of N generates shard i (0-based) of the
# job into OUTPUT/shard-0000i-of-0000N/. Resubmitting the array (or one task) resumes.
#SBATCH --job-name=eaglebatch
#SBATCH --array=0-7
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --requeue
set -euo pipefail
JOB=${JOB:-jobs/quickstart.yaml}
eaglebatch run "$JOB" --shard auto   # SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT
# Afterwards (e.g. a dependent job: sbatch --dependency=afterok:<array id>):
#   eaglebatch status "$JOB"   # exit 0 only when every row is written exactly once
