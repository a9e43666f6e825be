"""The layout gates (scripts/import_cycles.py, scripts/rust_module_cycles.py) find what they are
for: a module loop, a wing loop and an unexplained or needless lazy import in a small package
written here, and the real trees pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import import_cycles as ic  # noqa: E402


def package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        f = tmp_path / "eaglebatch" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return ic.modules()


@pytest.fixture
def tmp_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(ic, "ROOT", tmp_path)
    return tmp_path


def test_a_module_loop_and_a_wing_loop_are_found(tmp_root) -> None:
    mods = package(tmp_root, {
        "__init__.py": "", "a.py": "from eaglebatch import b\n",
        "b.py": "def f():\n    import eaglebatch.a  # numpy\n",
        "job/__init__.py": "", "job/x.py": "from eaglebatch.out.y import g\n",
        "out/__init__.py": "", "out/y.py": "from eaglebatch.job import x\n",
    })  # fmt: skip
    graph = ic.edges(mods)
    assert ic.loops(graph) == [["eaglebatch.a", "eaglebatch.b"],
                               ["eaglebatch.job.x", "eaglebatch.out.y"]]  # fmt: skip
    assert ["eaglebatch.job", "eaglebatch.out"] in ic.loops(ic.wing_edges(graph))


def test_lazy_imports_must_keep_something_heavy_out_and_say_so(tmp_root) -> None:
    mods = package(tmp_root, {
        "__init__.py": "", "light.py": "import json\n", "heavy.py": "import torch\n",
        "user.py": ("def a():\n    from eaglebatch import light\n\n\n"
                    "def b():\n    from eaglebatch import heavy\n\n\n"
                    "def c():\n    # lazy: torch\n    from eaglebatch import heavy\n"
                    "    from eaglebatch.light import x\n"),
    })  # fmt: skip
    faults = ic.lazy_import_faults(mods)
    assert len(faults) == 3, faults
    assert "user.py:2: lazy import of ['eaglebatch.light'] pulls nothing heavy" in faults[0]
    assert "user.py:6: lazy import without a reason" in faults[1]
    assert "user.py:12: lazy import of ['eaglebatch.light']" in faults[2]


@pytest.mark.parametrize("script", ["import_cycles.py", "rust_module_cycles.py"])
def test_the_real_trees_pass(script) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / script)], capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
