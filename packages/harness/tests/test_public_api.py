"""The harness and export reach the engine through edge_infer.api alone, and that import is cheap."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]  # the repository's packages/
SOURCES = [PACKAGES / "harness" / "src", PACKAGES / "export" / "src"]


def engine_imports(path: Path) -> list[str]:
    """'line: module' for every import of an edge_infer module other than edge_infer.api."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from edge_infer import api` is the API too; `from edge_infer import profiles` not
            names = ([f"{node.module}.{a.name}" for a in node.names]
                     if node.module == "edge_infer" else [node.module])
        else:
            continue
        bad += [f"{node.lineno}: {n}" for n in names
                if (n == "edge_infer" or n.startswith("edge_infer.")) and n != "edge_infer.api"]
    return bad


def test_harness_and_export_import_only_the_engine_api():
    files = [p for src in SOURCES for p in sorted(src.rglob("*.py"))]
    assert len(files) > 20, f"found only {len(files)} files under {SOURCES}"
    bad = {str(p.relative_to(PACKAGES)): found for p in files if (found := engine_imports(p))}
    assert not bad, f"import these from edge_infer.api (add what is missing there): {bad}"


def test_the_check_sees_private_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import edge_infer\nfrom edge_infer import api, profiles\n"
                 "from edge_infer.api import home\nimport edge_infer.api\n"
                 "def g():\n    from edge_infer.kernels import ext\n")
    assert engine_imports(f) == ["1: edge_infer", "2: edge_infer.profiles",
                                 "6: edge_infer.kernels"]


def test_importing_the_api_does_not_import_torch_or_vllm():
    code = ("import sys, edge_infer.api as api\n"
            "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)\n"
            "print(heavy, len(api.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("[] "), out.stdout + out.stderr


def test_every_public_name_resolves():
    import edge_infer.api as api

    cheap = [n for n in api.__all__ if n not in api._LAZY]
    assert all(hasattr(api, n) for n in cheap)
    assert set(api._LAZY) <= set(api.__all__)
    assert callable(api.corpus_text)  # a lazy one: imports its module now
