"""Imports point down: server -> engine -> drafting -> runtime -> models, layers (docs/ARCHITECTURE.md)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specserve"
# a package and the packages it must not import (those above it)
ABOVE = {"runtime": ("engine", "drafting", "server"), "drafting": ("engine", "server"), "engine": ("server",),
         "models": ("engine", "drafting", "runtime", "server"), "layers": ("engine", "drafting", "runtime", "server",
                                                                           "models")}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_import_points_up(package):
    bad = [(path.name, name) for path in sorted((PACKAGE / package).glob("*.py")) for name in imported_modules(path)
           if any(name == f"specserve.{up}" or name.startswith(f"specserve.{up}.") for up in ABOVE[package])]
    assert not bad, f"specserve/{package} imports from above it: {bad}"


def test_no_file_is_long():
    long = [(str(p.relative_to(PACKAGE)), n) for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300 and "train" not in p.parts]
    assert not long, f"files over 300 lines (training code aside): {long}"
