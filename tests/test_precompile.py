"""The install's precompile step writes bytecode where a run's processes will read it."""

from __future__ import annotations

import sys
from pathlib import Path


def test_precompile_writes_bytecode_under_its_root_even_when_python_would_not(tmp_path, monkeypatch):
    """PYTHONDONTWRITEBYTECODE (set on this machine) had turned the install's precompile step into a no-op: it
    must write the bytecode of what was imported under its root, and nothing outside it."""
    import importlib
    import importlib.util

    from pipprune.precompile import compile_imported

    inside, outside = tmp_path / "venv", tmp_path / "src"
    modules = {"pp_inside_mod": inside, "pp_outside_mod": outside}
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    for name, folder in modules.items():
        folder.mkdir()
        (folder / f"{name}.py").write_text("VALUE = 1\n")
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.import_module(name)
    cached = {name: Path(importlib.util.cache_from_source(str(folder / f"{name}.py"))) for name, folder in modules.items()}
    assert not any(path.exists() for path in cached.values())  # the import wrote nothing

    assert compile_imported(inside.resolve()) == 1
    assert cached["pp_inside_mod"].is_file() and not cached["pp_outside_mod"].exists()
    assert compile_imported(inside.resolve()) == 0  # already there
    for name in modules:
        sys.modules.pop(name, None)
