"""`--out`: copy a finished model to a user's path without ever removing or overwriting what pipprune did not write.

A directory counts as pipprune's only when its provenance file says so and lists every file in it
with its sha256: then, and only with `overwrite`, it is replaced. Anything else that is not empty
(a user's models, a file, a previous output someone added a file to or edited) is refused, in the
preflight before any work and again just before writing, since the path may change during a run.
The copy is written beside the target and moved into place with one rename (an atomic exchange
when replacing), so a reader never sees a half-written model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from infra.hashing import sha256_file

log = logging.getLogger(__name__)

PROVENANCE = "pipprune_provenance.json"
#: the provenance key that marks a directory as written by pipprune, and its format version
MARKER = "pipprune_output"


class OutputDirError(ValueError):
    """The output path cannot be written without touching something pipprune did not write."""


def _files(root: Path) -> dict[str, Path]:
    """Every entry below `root` that is not a directory (symlinks and special files included), by relative path."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            path = Path(dirpath) / name
            found[path.relative_to(root).as_posix()] = path
    return found


def foreign_files(out: Path) -> list[str] | None:
    """Files in `out` that its provenance does not list with their sha256; None if it is not a pipprune output."""
    try:
        provenance = json.loads((out / PROVENANCE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(provenance, dict) or not isinstance(provenance.get(MARKER), dict):
        return None
    listed = provenance[MARKER].get("files") or {}
    foreign = []
    for rel, path in sorted(_files(out).items()):
        if rel == PROVENANCE:
            continue
        if path.is_symlink() or not path.is_file() or listed.get(rel) != sha256_file(path):
            foreign.append(rel)
    return foreign


def check_output_dir(out: Path, overwrite: bool) -> Path:
    """Refuse an output path whose writing would remove or overwrite anything pipprune did not write.

    Returns the absolute path. Creates nothing.
    """
    out = Path(os.path.abspath(out.expanduser()))
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        kind = "a symbolic link" if out.is_symlink() else "a file"
        raise OutputDirError(f"--out {out} is {kind}, not a directory: pipprune never replaces a file it did not "
                             "write; choose a new directory path")
    if out.is_dir() and any(out.iterdir()):
        foreign = foreign_files(out)
        if foreign is None:
            sample = sorted(p.name for p in out.iterdir())[:3]
            raise OutputDirError(f"--out {out} is a non-empty directory that pipprune did not write (it holds "
                                 f"{', '.join(sample)}{', ...' if len(list(out.iterdir())) > 3 else ''}); choose a "
                                 "new or empty directory, e.g. --out " + str(out / "pruned-model"))
        if foreign:
            raise OutputDirError(f"--out {out} holds a previous pipprune output, but also files pipprune did not "
                                 f"write or that changed since ({', '.join(foreign[:3])}"
                                 f"{', ...' if len(foreign) > 3 else ''}); move them away or choose another directory")
        if not overwrite:
            raise OutputDirError(f"--out {out} holds a previous pipprune output; pass --overwrite to replace it, "
                                 "or choose another directory")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputDirError(f"--out {out}: cannot create it, {ancestor} is not a writable directory")
    return out


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    return False


def write_output_dir(src: Path, out: Path, summary: dict, overwrite: bool = False) -> Path:
    """Copy the model in `src` to `out` with a provenance file listing every file; atomic; returns `out`."""
    out = check_output_dir(out, overwrite)  # again: the path may have changed while the job ran
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.pipprune-partial-", dir=out.parent))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True, symlinks=False)
        (tmp / PROVENANCE).unlink(missing_ok=True)  # the source's own provenance describes another copy
        files = {rel: sha256_file(path) for rel, path in sorted(_files(tmp).items())}
        (tmp / PROVENANCE).write_text(json.dumps({MARKER: {"version": 1, "files": files}, **summary}, indent=1))
        os.chmod(tmp, 0o755)  # mkdtemp made it private; a model dir is as readable as any other
        if out.is_dir() and any(out.iterdir()):
            _replace_previous(tmp, out)
        else:
            os.rename(tmp, out)  # over nothing or an empty dir; fails (no data lost) if something appeared
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_previous(tmp: Path, out: Path) -> None:
    """Swap a previous pipprune output for the new copy, then remove the old one if it is still only ours."""
    if _exchange(tmp, out):
        old = tmp
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.pipprune-old-", dir=out.parent))
        os.rename(out, old / out.name)
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(old / out.name, out)
            raise
        old = old / out.name
    if foreign_files(old) == []:
        shutil.rmtree(old.parent if old.name == out.name else old)
    else:  # someone wrote into it since the check: keep it, say where
        log.warning("the replaced output held files pipprune did not write; kept it at %s", old)
