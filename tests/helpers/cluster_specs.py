"""Cluster specs as a job's platform hands them to each task, and the ConfigError a bad one gives.

The fixtures (tests/fixtures) are the JSON examples of Google's documents (shared/seeds), with
their placeholders ([ID_STRING_1], "port", "job": {...}) filled with concrete values:
- vertex_cluster_spec.json: Vertex AI CLUSTER_SPEC, workerpool0..3 (document 003);
- vertex_tf_config.json: the TF_CONFIG Vertex AI sets beside it (document 003);
- ai_platform_tf_config_chief.json: AI Platform TF_CONFIG with a chief (documents 000, 001);
- ai_platform_tf_config_master.json: the same job with the older master name (000, 001);
- ai_platform_cluster_spec.json: AI Platform custom-container CLUSTER_SPEC with
  master/worker/ps (document 004 describes it; it has no JSON example, so this one is built
  from its facts);
- tf_config_no_chief.json: TensorFlow's three workers and two ps (document 002).
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Dict

import pytest

from reduction_server.errors import ConfigError

from .source_tree import ROOT

FIXTURES = ROOT / "tests" / "fixtures"

VERTEX_REDUCERS = ("cmle-training-workerpool2-ab-0:2222", "cmle-training-workerpool2-ab-1:2222")
CHIEF_PS = ("cmle-training-ps-5d1e8f0c-0:2222",)


def load(name: str) -> Dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def as_task(document: Dict[str, Any], task_type: str, index: int) -> str:
    """The document as the process running task `task_type`[`index`] sees it."""
    seen = copy.deepcopy(document)
    seen["task"] = dict(seen.get("task", {}), type=task_type, index=index)
    return json.dumps(seen)


def vertex(task_type: str, index: int, **extra: str) -> Dict[str, str]:
    return dict(CLUSTER_SPEC=as_task(load("vertex_cluster_spec.json"), task_type, index), **extra)


def tf_config(fixture: str, task_type: str, index: int, **extra: str) -> Dict[str, str]:
    return dict(TF_CONFIG=as_task(load(fixture), task_type, index), **extra)


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def config_error(call, environ: Dict[str, str]) -> str:
    with pytest.raises(ConfigError) as caught:
        call(environ)
    return str(caught.value)
