"""The Dockerfile builds the image the KubeRay RayService names, for the versions the project pins.

Owns: the cross-file contract of the image: its base is Ray's own image for the Ray version that
pyproject.toml pins (and cluster.yaml installs, and rayVersion declares) and for the Python version
the project runs on; its torch is the pinned one; every pod of the RayService and docs/deploying.md
name the image the Dockerfile's build command tags. No Docker engine is needed (none runs here).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _arg(name: str) -> str:
    [value] = re.findall(rf"^ARG {name}=(\S+)$", DOCKERFILE, flags=re.M)
    return value


def _pinned(package: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [version] = [m.group(1) for d in deps if (m := re.fullmatch(rf"{package}(?:\[[\w,]+\])?==([\w.]+)", d))]
    return version


def _python() -> str:
    """The Python the project runs on: README's first command and .ci/run's default (python3.11)."""
    readme = re.findall(r"python(3\.\d+) -m venv", (ROOT / "README.md").read_text())
    ci = re.findall(r"PY=\$\{PYTHON:-python(3\.\d+)\}", (ROOT / ".ci" / "run").read_text())
    assert readme and ci and set(readme) == set(ci), (readme, ci)
    return readme[0]


def test_the_base_is_rays_image_for_the_pinned_ray_and_python() -> None:
    [base] = re.findall(r"^FROM (\S+)$", DOCKERFILE, flags=re.M)
    assert base == "rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu"
    assert _arg("RAY_VERSION") == _pinned("ray")
    assert _arg("PYTHON_TAG") == "py" + _python().replace(".", "")


def test_torch_is_the_pinned_version_in_its_cuda_build() -> None:
    [torch] = re.findall(r"pip install --no-cache-dir 'torch==([\w.]+)' --index-url \$\{TORCH_INDEX\}", DOCKERFILE)
    assert torch == _pinned("torch")
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", _arg("TORCH_INDEX"))
    assert DOCKERFILE.index("'torch==") < DOCKERFILE.index("pip install --no-cache-dir /home/ray/mmserve")


def test_the_configs_name_the_image_the_dockerfile_builds_and_one_ray() -> None:
    [tag] = re.findall(r"docker build -t (\S+) \.", DOCKERFILE)
    service = yaml.safe_load((ROOT / "deployments" / "kuberay" / "rayservice.yaml").read_text())
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert {c["image"] for pod in pods for c in pod["spec"]["containers"]} == {tag}
    assert cluster["rayVersion"] == _pinned("ray")
    assert set(re.findall(r"ray\[[a-z,]+\]==([\w.]+)", (ROOT / "cluster.yaml").read_text())) == {_pinned("ray")}
    assert f"docker build -t {tag} ." in (ROOT / "docs" / "deploying.md").read_text()
