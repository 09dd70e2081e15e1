"""The house rules that code review alone lets slip: the engine's folders are the request's stages, shared
code never names a model, the engine never imports Ray, and the HTTP edge never imports the model's
libraries."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mmserve"
STAGES = {"preprocess", "encoder", "decoder"}  # the request's path, in order
HOMES = {"models", "api", "runtime"}  # the model seam, the OpenAI edge, the machinery that runs a stage
ROOT_MODULES = {"__init__", "__main__", "config", "messages", "errors", "engine", "stages"}


def _modules(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def _identifiers(tree: ast.AST) -> set[str]:
    """Every name the code uses: imports, names, attributes, definitions (not strings or comments)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


def test_the_folders_are_the_stages_and_the_root_holds_what_all_share() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == STAGES | HOMES
    assert {p.stem for p in PACKAGE.glob("*.py")} <= ROOT_MODULES


def test_no_module_outside_models_names_a_model() -> None:
    offenders = {}
    for path in _modules(PACKAGE):
        if path.is_relative_to(PACKAGE / "models"):
            continue
        named = {n for n in _identifiers(ast.parse(path.read_text())) if re.search("gemma", n, re.I)}
        if named:
            offenders[str(path.relative_to(PACKAGE))] = sorted(named)
    assert not offenders, f"shared code names a model (only mmserve/models may): {offenders}"


def test_the_engine_never_imports_ray() -> None:
    offenders = []
    for path in _modules(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "ray" or n.startswith("ray.") for n in names):
                offenders.append(str(path.relative_to(PACKAGE)))
    assert not offenders, f"mmserve/ is pure Python; Ray belongs in deployments/: {offenders}"


def test_the_http_edge_imports_neither_torch_nor_transformers() -> None:
    """The ingress (and the engine's OpenAI edge it is built on) starts without the model's libraries: each
    ingress replica would pay their start-up time and memory (docs/benchmarks.md). NOTE: a fresh
    interpreter, since this one has imported both long ago; importing `deployments.ingress` imports Ray's
    modules, starts no Ray."""
    code = ("import sys, deployments.ingress, mmserve.api.protocol, mmserve.api.stream, mmserve.api.structured; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
