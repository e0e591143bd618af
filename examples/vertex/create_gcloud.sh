#!/usr/bin/env bash
# Create the CustomJob of custom_job.json with gcloud. Pools, in order: workerpool0 (the primary
# replica), workerpool1 (the workers), workerpool2 (the reducers: this repository's image, whose
# entry point is `reduction-server serve`); no evaluator pool.
# Sizing (docs/deployment.md): 5 worker hosts x 100 Gbps = 500 Gbps; an n1-highcpu-16 has
# 32 Gbps of egress, so ceil(500 / 32) = 16 reducers (512 Gbps).
#
#   PROJECT_ID=my-project RS_JOB_TOKEN=$(openssl rand -hex 16) ./create_gcloud.sh          # from the spec file
#   PROJECT_ID=my-project ./create_gcloud.sh flags                                      # flags only
set -euo pipefail
cd "$(dirname "$0")"

: "${PROJECT_ID:?set PROJECT_ID}"
REGION="${REGION:-us-central1}"
TRAINER_IMAGE="us-docker.pkg.dev/${PROJECT_ID}/training/trainer:latest"
REDUCER_IMAGE="us-docker.pkg.dev/${PROJECT_ID}/reduction-server/reducer:0.1.0"

if [[ "${1:-spec}" == "flags" ]]; then
  # The same three pools as flags, as in Vertex AI's Reduction Server example. gcloud has no
  # per-pool command or environment flags (--command/--args would replace the reducer image's
  # entry point too), so the trainer image's own ENTRYPOINT must start training
  # (torchrun --standalone --nproc_per_node=8 ...) and set RS_PROCS_PER_HOST=8, and the reducer
  # image needs RS_PROCS_PER_HOST=8 baked in (a one-line Dockerfile FROM it). No job token:
  # use the spec file for that; without one a reducer refuses to start unless the image also
  # bakes in RS_ALLOW_NO_TOKEN=1 (anyone who reaches its port may then join the job).
  exec gcloud ai custom-jobs create \
    --project="${PROJECT_ID}" \
    --region="${REGION}" \
    --display-name=train-with-reduction-server \
    --worker-pool-spec="machine-type=n1-highmem-96,replica-count=1,accelerator-type=NVIDIA_TESLA_V100,accelerator-count=8,container-image-uri=${TRAINER_IMAGE}" \
    --worker-pool-spec="machine-type=n1-highmem-96,replica-count=4,accelerator-type=NVIDIA_TESLA_V100,accelerator-count=8,container-image-uri=${TRAINER_IMAGE}" \
    --worker-pool-spec="machine-type=n1-highcpu-16,replica-count=16,container-image-uri=${REDUCER_IMAGE}"
fi

# The spec file carries each pool's command and environment; fill in the project and token.
: "${RS_JOB_TOKEN:?set RS_JOB_TOKEN to a random secret shared by every replica}"
spec="$(mktemp --suffix=.yaml)"
trap 'rm -f "${spec}"' EXIT
sed -e "s#PROJECT_ID#${PROJECT_ID}#g" -e "s#REPLACE_WITH_A_RANDOM_SECRET#${RS_JOB_TOKEN}#g" \
  custom_job_spec.yaml > "${spec}"
gcloud ai custom-jobs create \
  --project="${PROJECT_ID}" \
  --region="${REGION}" \
  --display-name=train-with-reduction-server \
  --config="${spec}"
