"""One set of versions everywhere: requirements.lock pins every package that make, CI and the
image install (torch aside), and the environment the tests run in is exactly that set."""

import re
import sysconfig
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_LOCKED = {"torch", "pip", "setuptools", "wheel"}  # torch: requirements-cpu.txt or the base


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a requirements file."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            found[norm(name)] = version.strip()
    return found


LOCK = pins(ROOT / "requirements.lock")


def test_every_top_level_pin_is_the_locked_version():
    for name in ("requirements.txt", "requirements-dev.txt"):
        for package, version in pins(ROOT / name).items():
            assert LOCK.get(package) == version, (
                f"{name}: {package}=={version}, lock: {LOCK.get(package)}"
            )


def test_torch_is_pinned_once_outside_the_lock():
    assert "torch" not in LOCK
    assert set(pins(ROOT / "requirements-cpu.txt")) == {"torch"}


def test_the_test_environment_is_the_lock():
    # what the environment installed, not all of sys.path: setuptools, once torch.compile has
    # imported it, appends its _vendor folder of other versions (packaging 24, ...) to sys.path
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {
        norm(d.metadata["Name"]): d.version
        for d in metadata.distributions(path=site)
        if norm(d.metadata["Name"]) not in NOT_LOCKED
    }
    missing = {p: v for p, v in LOCK.items() if installed.get(p) != v}
    extra = {p: v for p, v in installed.items() if p not in LOCK}
    assert not missing, f"locked but not installed at that version (make install): {missing}"
    assert not extra, f"installed but not in requirements.lock (make lock): {extra}"
