"""Wheels that let benchmarks/gpu_check.sh run the compress flow on the lent GPU machine, which has no network.

That machine's image holds torch and much of the scientific stack (benchmarks/gpu_image_packages.txt), but not
prefect, mlflow, boto3, pydantic or the `weed` S3 server. This walks pipprune's requirements (pyproject.toml) through
the distributions installed in the running environment (run it with the project's venv), honouring markers for the
target Python, pins each to the version installed here, and leaves out torch/nvidia-*/triton, what the image already
has, and what the compress flow never imports (NOT_NEEDED). It downloads manylinux x86-64 wheels for that Python and
packs them into DEST/part1, DEST/part2, ... of at most --part-mib each: one device call carries at most 64 MiB, the
repository included, so the parts travel in consecutive calls (`gpu_check.sh --install-only` stages the first).

Usage: /work/main/.venv/bin/python -m benchmarks.gpu_wheels [--list] [--dest .whl] [--python-version 3.12]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import lzma
import platform
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging import tags
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "benchmarks" / "gpu_image_packages.txt"
#: the image's own build of these must be used (CUDA); never carried
SYSTEM = {"torch", "triton"}
SYSTEM_PREFIXES = ("nvidia-",)
#: requirements of pipprune that the compress flow (and the stack it starts) never imports, with the reason.
#: Their own requirements are left out too unless something kept needs them. Checked by running the flow with only
#: the kept set installed (benchmarks/gpu_wheels.py's docstring, docs/scale-out.md "Devices and dtypes").
NOT_NEEDED = {
    "lm-eval": "imported only by `--tasks` evaluation (infra/lmeval.py); gpu_check's flow runs no lm-eval task",
    "rdata": "imported only by the reference builder (infra/reference/sources.py)",
    "apprise": "Prefect's notification blocks; never imported by the flow or `prefect server`",
    "huey": "MLflow's job runner, switched off by the stack (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false)",
    "gunicorn": "`mlflow server` runs under uvicorn here",
    "graphene": "MLflow's GraphQL endpoint, used by its web UI only",
}
#: carried beside pipprune's requirements: the fused CUDA loss pip_core uses when installed (pip_core/chunked_loss.py)
EXTRAS = ("liger-kernel==0.8.5",)
#: carried although the image has them: tiny, and pydantic-core needs a recent one (typing-extensions>=4.16)
ALSO_CARRY = ("typing-extensions",)
#: wheels at least this big are re-packed (entries stored, the whole file xz-compressed) when that saves a fifth or more:
#: the `weed` binary goes from 45 to 32 MiB, mlflow's web assets from 11.5 to 7 MiB; gpu_check.sh unpacks them
XZ_MIN_MIB, XZ_MAX_RATIO = 8.0, 0.8
#: glibc of the image (Ubuntu 24.04: 2.39); pip matches manylinux_2_N exactly, so every N up to it is offered
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    why: str  # the requirement chain that brought it in

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def image_packages(path: Path = IMAGE_LIST) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line}


def target_environment(python_version: str) -> dict[str, str]:
    """Marker values of the GPU machine's interpreter (CPython on Linux x86-64), not of this one."""
    env = default_environment()
    here = platform.python_version()
    full = {"3.12": "3.12.3", here.rsplit(".", 1)[0]: here}.get(python_version, f"{python_version}.0")
    env.update(python_version=python_version, python_full_version=full, sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix", implementation_name="cpython",
               platform_python_implementation="CPython")
    return env


def root_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def _applies(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in ({""} | extras))


def _extra_only(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    """True when `req` comes only with one of `extras` (not with the plain distribution)."""
    return req.marker is not None and not req.marker.evaluate({**env, "extra": ""}) and _applies(req, env, extras)


def closure(roots: list[Requirement], env: dict[str, str], skip: set[str], image: set[str]) -> dict[str, Pin]:
    """Every distribution the roots need on the target, pinned to the version installed here.

    Names in `skip`, and what only they need, are left out. A distribution of the image brings its own requirements
    there (its version there may differ from ours, and so may they), so of those only the ones of an extra asked for
    (e.g. `httpx[http2]`) are followed. A requirement that is not installed here is an error: pins come from here.
    """
    pins: dict[str, Pin] = {}
    done_extras: dict[str, set[str]] = {}
    queue: list[tuple[Requirement, str]] = [(r, "pipprune") for r in roots if _applies(r, env, set())]
    while queue:
        req, parent = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in skip:
            continue
        wanted = {canonicalize_name(e) for e in req.extras}
        seen = done_extras.get(name)
        if seen is not None and wanted <= seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise SystemExit(f"gpu_wheels: {req} (needed by {parent}) is not installed in {sys.prefix}") from None
        if not req.specifier.contains(dist.version, prereleases=True):
            raise SystemExit(f"gpu_wheels: {parent} needs {req}, but {dist.version} is installed here")
        done_extras[name] = (seen or set()) | wanted
        pins.setdefault(name, Pin(name, dist.version, parent))
        follows = _extra_only if name in image else _applies
        for sub in map(Requirement, dist.requires or []):
            if follows(sub, env, wanted):
                queue.append((sub, f"{parent} > {name}" if parent != "pipprune" else name))
    return pins


def needed(python_version: str) -> tuple[dict[str, Pin], dict[str, Pin]]:
    """(to carry, already in the image) for the compress flow on the GPU machine."""
    env = target_environment(python_version)
    system = {n for n in (canonicalize_name(d.metadata["Name"]) for d in md.distributions())
              if n in SYSTEM or n.startswith(SYSTEM_PREFIXES)} | SYSTEM
    image = image_packages()
    pins = closure(root_requirements(), env, skip=system | set(NOT_NEEDED), image=image)
    for extra in map(Requirement, EXTRAS):
        name = canonicalize_name(extra.name)
        pins[name] = Pin(name, str(next(iter(extra.specifier)).version), "gpu_check (optional fused loss)")
    keep = image - {canonicalize_name(n) for n in ALSO_CARRY}
    return ({n: p for n, p in pins.items() if n not in keep and not n.startswith(SYSTEM_PREFIXES)},
            {n: p for n, p in pins.items() if n in keep})


def _pip_download(specs: list[str], dest: Path, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(dest)]
    subprocess.run([*cmd, *specs], check=True)


def supported_tags(python_version: str) -> set[tags.Tag]:
    """The wheel tags a CPython of `python_version` on manylinux x86-64 installs."""
    version = tuple(int(x) for x in python_version.split("."))
    return {*tags.cpython_tags(version, platforms=PLATFORMS),
            *tags.compatible_tags(version, f"cp{python_version.replace('.', '')}", platforms=PLATFORMS)}


def download(pins: list[Pin], cache: Path, python_version: str) -> dict[str, Path]:
    """One wheel per pin in `cache` (reused when already there and installable on the target)."""
    cache.mkdir(parents=True, exist_ok=True)
    supported = supported_tags(python_version)

    def present() -> dict[tuple[str, str], Path]:
        found: dict[tuple[str, str], Path] = {}
        for wheel in sorted(cache.glob("*.whl"), key=lambda p: p.stat().st_mtime):
            name, version, _, wheel_tags = parse_wheel_filename(wheel.name)
            if wheel_tags & supported:
                found[(name, str(version))] = wheel
        return found

    missing = [p.spec for p in pins if (p.name, p.version) not in present()]
    if missing:
        _pip_download(missing, cache, python_version)
    have = present()
    absent = [p.spec for p in pins if (p.name, p.version) not in have]
    if absent:
        raise SystemExit(f"gpu_wheels: no wheel came for {absent}")
    return {p.name: have[(p.name, p.version)] for p in pins}


def smaller(wheel: Path) -> Path:
    """`wheel`, or NAME.whl.xz beside it (zip entries stored, then xz: far smaller for binaries and web assets)."""
    if wheel.stat().st_size < XZ_MIN_MIB * 2**20:
        return wheel
    packed = wheel.with_name(wheel.name + ".xz")
    if not packed.is_file():
        buffer = io.BytesIO()
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                data = src.read(info)
                info.compress_type = zipfile.ZIP_STORED
                dst.writestr(info, data)
        tmp = packed.with_suffix(".tmp")
        tmp.write_bytes(lzma.compress(buffer.getvalue(), preset=9))
        tmp.replace(packed)
    return packed if packed.stat().st_size <= XZ_MAX_RATIO * wheel.stat().st_size else wheel


def pack(wheels: list[Path], dest: Path, part_mib: float) -> list[Path]:
    """First-fit decreasing into dest/partN folders of at most `part_mib`; old partN folders are replaced."""
    limit = part_mib * 2**20
    bins: list[tuple[int, list[Path]]] = []
    for wheel in sorted(wheels, key=lambda p: -p.stat().st_size):
        size = wheel.stat().st_size
        if size > limit:
            raise SystemExit(f"gpu_wheels: {wheel.name} alone is {size / 2**20:.1f} MiB, over the part limit")
        for i, (used, files) in enumerate(bins):
            if used + size <= limit:
                bins[i] = (used + size, [*files, wheel])
                break
        else:
            bins.append((size, [wheel]))
    for old in dest.glob("part*"):
        if old.is_dir() and old.name[4:].isdigit():
            shutil.rmtree(old)
    parts = []
    for i, (_, files) in enumerate(bins, start=1):
        part = dest / f"part{i}"
        part.mkdir(parents=True)
        for wheel in files:
            shutil.copy2(wheel, part / wheel.name)
        parts.append(part)
    return parts


def check_installed(site: Path) -> list[str]:
    """Requirements of the distributions installed in `site` that this environment does not meet (run on the GPU
    machine after the install): a version of the image that a carried wheel does not accept, or a distribution the
    image was assumed to have. What NOT_NEEDED leaves out is not reported."""
    env = default_environment()
    problems = []
    for dist in md.distributions(path=[str(site)]):
        for req in map(Requirement, dist.requires or []):
            name = canonicalize_name(req.name)
            if (req.marker is not None and not req.marker.evaluate({**env, "extra": ""})) or name in NOT_NEEDED:
                continue
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {req}: missing")
                continue
            if not req.specifier.contains(version, prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {req}: {version} is installed")
    return sorted(set(problems))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="parts go to DEST/partN")
    parser.add_argument("--python-version", default="3.12", help="the target interpreter (the GPU machine: 3.12)")
    parser.add_argument("--part-mib", type=float, default=58.0, help="largest part (a call carries <= 64 MiB in all)")
    parser.add_argument("--list", action="store_true", help="print the pins, download nothing")
    parser.add_argument("--check", type=Path, metavar="SITE", help="report unmet requirements of what SITE holds")
    args = parser.parse_args()
    if args.check:
        problems = check_installed(args.check)
        print("gpu_wheels: " + ("; ".join(problems) if problems else "every requirement of the carried wheels is met"))
        return
    carry, image = needed(args.python_version)
    print(f"in the image already ({len(image)}): " + ", ".join(sorted(p.spec for p in image.values())))
    print(f"left out, not imported by the compress flow: {', '.join(NOT_NEEDED)}")
    print(f"to carry ({len(carry)}):")
    for pin in sorted(carry.values(), key=lambda p: p.name):
        print(f"  {pin.spec:45s} <- {pin.why}")
    if args.list:
        return
    tag = "cp" + args.python_version.replace(".", "")
    wheels = download(list(carry.values()), args.dest / ".cache" / tag, args.python_version)
    parts = pack([smaller(w) for w in wheels.values()], args.dest, args.part_mib)
    for part in parts:
        files = sorted(part.glob("*.whl*"))
        size = sum(f.stat().st_size for f in files)
        print(f"{part}: {len(files)} wheels, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
