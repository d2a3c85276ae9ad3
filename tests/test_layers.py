"""The layers of the design card, read off the source: every import, at module level or inside a function, points
down (cli -> flows -> tasks -> infra -> pip_core), and pip_core imports no orchestration library."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: lowest first: a package may import from its own layer and those before it
LAYERS = ("pip_core", "infra", "tasks", "flows", "pipprune")
#: what the algorithm must run without (design card: pip_core is pure torch + transformers)
ORCHESTRATION = ("prefect", "mlflow", "boto3", "botocore", "dask", "distributed", "lm_eval")


def imports(package: str) -> Iterator[tuple[str, int, str]]:
    """(file, line, imported module) for every absolute import in `package`'s source."""
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                yield str(path.relative_to(ROOT)), node.lineno, name


def layer_graph() -> Counter[tuple[str, str]]:
    """(importer layer, imported layer) -> number of imports: the project's import graph between layers."""
    return Counter((package, name.split(".")[0]) for package in LAYERS for _, _, name in imports(package)
                   if name.split(".")[0] in LAYERS and name.split(".")[0] != package)


def test_no_import_points_up_the_layers() -> None:
    upward = [f"{file}:{line} imports {name}" for package in LAYERS for file, line, name in imports(package)
              if name.split(".")[0] in LAYERS and LAYERS.index(name.split(".")[0]) > LAYERS.index(package)]
    assert upward == []
    assert ("flows", "tasks") in layer_graph()  # the walk sees imports at all


def test_pip_core_imports_no_orchestration_library() -> None:
    found = [f"{file}:{line} imports {name}" for file, line, name in imports("pip_core")
             if name.split(".")[0] in ORCHESTRATION]
    assert found == []


if __name__ == "__main__":  # the graph, for a closing note: python -m tests.test_layers
    for (src, dst), n in sorted(layer_graph().items(), key=lambda e: (LAYERS.index(e[0][0]), LAYERS.index(e[0][1]))):
        print(f"{src:9} -> {dst:9} {n:3d} imports")
