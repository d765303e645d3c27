"""The layers import one way and no modules import each other in a cycle (tools/import_graph.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "import_graph.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_the_package_imports_one_way_without_cycles():
    out = _run()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no upward import, no cycle" in out.stdout
    assert "UPWARD" not in out.stdout and "import cycle" not in out.stdout


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_fails_on_upward_imports_and_cycles(tmp_path):
    _write(
        tmp_path,
        {
            "seedflood_p2p/__init__.py": 'LAYERS = ("core", "apps")\n',
            "seedflood_p2p/core/__init__.py": "",
            "seedflood_p2p/core/a.py": "from seedflood_p2p.apps import b\n",
            "seedflood_p2p/core/d.py": "def f():\n    import peer.daemon\n",
            "seedflood_p2p/apps/__init__.py": "",
            "seedflood_p2p/apps/b.py": "import seedflood_p2p.apps.c\n",
            "seedflood_p2p/apps/c.py": "def g():\n    from . import b\n",
            "peer/__init__.py": "",
            "peer/daemon.py": "from seedflood_p2p.core import a\n",
            "bootstrap/__init__.py": "",
        },
    )
    out = _run("--root", str(tmp_path))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert any(
        line.startswith("upward import: seedflood_p2p/core/a.py:1:") and "(apps)" in line
        for line in lines
    )
    assert any(
        line.startswith("upward import: seedflood_p2p/core/d.py:2:") and "(daemon)" in line
        for line in lines
    )
    assert "import cycle: seedflood_p2p.apps.b <-> seedflood_p2p.apps.c" in lines
    assert "UPWARD" in out.stdout and out.stdout.rstrip().endswith("FAILED")


def test_a_module_outside_every_layer_is_refused(tmp_path):
    _write(
        tmp_path,
        {
            "seedflood_p2p/__init__.py": 'LAYERS = ("core",)\n',
            "seedflood_p2p/core/__init__.py": "",
            "seedflood_p2p/flat.py": "",
            "peer/__init__.py": "",
            "bootstrap/__init__.py": "",
        },
    )
    out = _run("--root", str(tmp_path))
    assert out.returncode == 1 and "seedflood_p2p.flat is in no layer" in out.stderr


def test_neither_the_product_nor_bench_imports_the_tests():
    """Tests and benchmarks share the harness (harness/), never each other: no module of
    the product or of bench/ imports from tests/ or puts tests/ on sys.path."""
    import ast

    offenders = []
    for top in ("seedflood_p2p", "peer", "bootstrap", "seedflood", "bench", "harness"):
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                offenders += [
                    f"{path}: {n}" for n in names if n.split(".")[0] in ("tests", "helpers")
                ]
            if '"tests")' in text and "sys.path" in text:
                offenders.append(f"{path}: tests/ on sys.path")
    assert not offenders, offenders
