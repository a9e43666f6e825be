#!/bin/bash
# A SLURM job array over eaglebatch shards: array task i generates shard i (0-based) of SHARDS
# into OUTPUT/shard-0000i-of-0000N/. Keep --array=0-(SHARDS-1) and SHARDS in step.
#
# Retry: resubmit only the tasks that failed, by their array ids; each reruns its own shard
# and resumes after the rows it already wrote:
#   sbatch --array=1 jobs/cluster/slurm-array.sh       # shard 1 again
#   sbatch --array=3,5 jobs/cluster/slurm-array.sh     # shards 3 and 5
# Then (e.g. a dependent job: sbatch --dependency=afterok:<array id>):
#   eaglebatch status "$JOB"   # exit 0 only when every row is written exactly once
#
# --signal: SIGTERM to eaglebatch 120 s before the time limit; it writes the rows it finished
# and exits 143, so with --requeue the task resumes where it stopped.
#SBATCH --job-name=eaglebatch
#SBATCH --array=0-7
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --signal=B:TERM@120
#SBATCH --requeue
set -euo pipefail
JOB=${JOB:-jobs/quickstart.yaml}
SHARDS=${SHARDS:-8}
VENV=${VENV:-$HOME/venvs/eaglebatch}   # where `pip install eaglebatch` went
if [ -f "$VENV/bin/activate" ]; then
  source "$VENV/bin/activate"
fi
# exec: eaglebatch replaces the batch shell, so the B:TERM signal reaches it
exec eaglebatch run "$JOB" --shard auto --shards "$SHARDS"   # shard = SLURM_ARRAY_TASK_ID
