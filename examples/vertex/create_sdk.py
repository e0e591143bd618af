"""Create the CustomJob of custom_job.json with the Vertex AI Python SDK (google-cloud-aiplatform).

    pip install google-cloud-aiplatform
    python examples/vertex/create_sdk.py --project my-project --region us-central1 \
        --staging-bucket gs://my-bucket --token "$(openssl rand -hex 16)"

The worker pools come from custom_job.json (one source of truth), in order: workerpool0 the
primary replica, workerpool1 the workers, workerpool2 the reducers (this repository's image:
`reduction-server serve`), workerpool3 empty (no evaluators). Sizing: docs/deployment.md.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Dict, List

SPEC = Path(__file__).resolve().parent / "custom_job.json"


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _to_proto_dict(value: Any) -> Any:
    """The REST JSON's camelCase keys as the SDK's (protobuf) snake_case field names."""
    if isinstance(value, dict):
        return {_snake(key): _to_proto_dict(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_proto_dict(item) for item in value]
    return value


def worker_pool_specs(project: str = "PROJECT_ID", token: str = "REPLACE_WITH_A_RANDOM_SECRET") -> List[Dict]:
    """custom_job.json's pools for aiplatform.CustomJob, with the project and token filled in."""
    text = SPEC.read_text().replace("PROJECT_ID", project).replace("REPLACE_WITH_A_RANDOM_SECRET", token)
    pools = _to_proto_dict(json.loads(text)["jobSpec"]["workerPoolSpecs"])
    for pool in pools:
        if "replica_count" in pool:  # int64 is a string in REST JSON, an int in the SDK
            pool["replica_count"] = int(pool["replica_count"])
    return pools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True)
    parser.add_argument("--region", default="us-central1")
    parser.add_argument("--staging-bucket", required=True, help="gs://... for the job's outputs")
    parser.add_argument("--token", required=True, help="RS_JOB_TOKEN: a random secret shared by every replica")
    parser.add_argument("--no-wait", action="store_true", help="submit and return")
    args = parser.parse_args()

    from google.cloud import aiplatform  # only needed to submit

    aiplatform.init(project=args.project, location=args.region, staging_bucket=args.staging_bucket)
    job = aiplatform.CustomJob(
        display_name=json.loads(SPEC.read_text())["displayName"],
        worker_pool_specs=worker_pool_specs(args.project, args.token),
    )
    if args.no_wait:
        job.submit()
    else:
        job.run()
    print(job.resource_name)


if __name__ == "__main__":
    main()
