"""Public-domain and permissively licensed text shipped in Debian packages, extracted offline.

Each source function returns clean text. Packages are installed on demand when running as root;
otherwise the error names the exact command to run.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import shutil
import struct
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

APT_PACKAGES = ("bible-kjv", "python3.11-doc", "fortunes", "wordnet-base", "wamerican-huge")
AUSTEN_DEB = "r-cran-janeaustenr"
AUSTEN_TRAIN = ("emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility")
AUSTEN_HELDOUT = "persuasion"
PY_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
FORTUNES = Path("/usr/share/games/fortunes")
WORDNET = Path("/usr/share/wordnet")
ENGLISH_WORDS = Path("/usr/share/dict/american-english-huge")


@dataclass(frozen=True)
class SourceInfo:
    name: str
    package: str
    license: str


SOURCES = {
    "austen": SourceInfo("Jane Austen: Emma, Mansfield Park, Northanger Abbey, Pride and Prejudice, Sense and "
                         "Sensibility", AUSTEN_DEB, "public domain"),
    "persuasion": SourceInfo("Jane Austen: Persuasion (held out)", AUSTEN_DEB, "public domain"),
    "kjv": SourceInfo("King James Bible", "bible-kjv", "public domain"),
    "pydocs": SourceInfo("Python 3.11 documentation prose", "python3.11-doc", "PSF-2.0"),
    "fortunes": SourceInfo("fortune cookie database", "fortunes", "BSD"),
    "words": SourceInfo("SCOWL American English word list, size 80", "wamerican-huge",
                        "SCOWL (copyright Kevin Atkinson; use, copy, modify, distribute and sell permitted)"),
    "wordnet": SourceInfo("WordNet 3.0 example sentences (evaluation only)", "wordnet-base", "WordNet 3.0 license"),
}


class MissingDataPackage(RuntimeError):
    """A Debian data package is missing and cannot be installed from here."""


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    subprocess.run(cmd, check=True, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def _present() -> dict[str, bool]:
    return {"bible-kjv": shutil.which("bible") is not None, "python3.11-doc": PY_DOCS.is_dir(),
            "fortunes": FORTUNES.is_dir(), "wordnet-base": (WORDNET / "data.noun").is_file(),
            "wamerican-huge": ENGLISH_WORDS.is_file()}


def ensure_apt_packages() -> None:
    """Install the data packages if missing (root only); else say exactly what to run."""
    missing = [p for p, ok in _present().items() if not ok]
    if not missing:
        return
    command = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if os.geteuid() != 0:
        raise MissingDataPackage(f"missing data packages {missing}; run: sudo apt-get update && sudo {' '.join(command)}")
    log.info("installing %s", " ".join(missing))
    try:
        _run(command)
    except subprocess.CalledProcessError:
        _run(["apt-get", "update"])
        _run(command)


def austen_dir(cache_dir: Path) -> Path:
    """The janeaustenr R data folder, unpacked from the .deb (installing it would pull in R)."""
    target = cache_dir / "janeaustenr"
    data = next(target.glob("usr/lib/R/site-library/janeaustenr/data"), None) if target.is_dir() else None
    if data is not None and (data / "Rdata.rdb").is_file():
        return data
    debs = cache_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{AUSTEN_DEB}_*.deb"))
    if not found:
        try:
            _run(["apt-get", "download", AUSTEN_DEB], cwd=debs)
        except (subprocess.CalledProcessError, FileNotFoundError):
            if os.geteuid() == 0:
                _run(["apt-get", "update"])
                _run(["apt-get", "download", AUSTEN_DEB], cwd=debs)
            else:
                raise MissingDataPackage(f"cannot download {AUSTEN_DEB}; run: cd {debs} && apt-get download {AUSTEN_DEB}") \
                    from None
        found = sorted(debs.glob(f"{AUSTEN_DEB}_*.deb"))
    _run(["dpkg-deb", "-x", str(found[-1]), str(target)])
    return next(target.glob("usr/lib/R/site-library/janeaustenr/data"))


def austen_books(cache_dir: Path) -> dict[str, str]:
    """Each novel as text, parsed from R's lazy-load database with `rdata`."""
    import warnings

    import rdata

    data = austen_dir(cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((data / "Rdata.rdx").read_bytes())))
        raw = (data / "Rdata.rdb").read_bytes()
        books = {}
        for name, (offset, length) in index["variables"].items():
            chunk = raw[int(offset): int(offset) + int(length)]
            (size,) = struct.unpack(">I", chunk[:4])
            body = zlib.decompress(chunk[4:])
            if len(body) != size:
                raise ValueError(f"janeaustenr chunk {name}: {len(body)} bytes, header says {size}")
            lines = rdata.conversion.convert(rdata.parser.parse_data(body))
            books[str(name)] = _paragraphs([str(x) for x in lines])
    return books


def _paragraphs(lines: list[str]) -> str:
    """Join wrapped lines into paragraphs separated by blank lines."""
    paras, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            paras.append(" ".join(current))
            current = []
    if current:
        paras.append(" ".join(current))
    return "\n\n".join(p for p in paras if len(p.split()) >= 4)


def kjv() -> str:
    out = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    verses = [re.sub(r"^\S+\d+:\d+\s+", "", line).strip() for line in out.splitlines()]
    return "\n".join(v for v in verses if v)


_RST_DIRECTIVE = re.compile(r"^\s*\.\. ")
_RST_ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def python_docs() -> str:
    """Prose of the Python docs: code blocks, directives, tables and markup removed."""
    paras: list[str] = []
    for path in sorted(PY_DOCS.rglob("*.rst.txt")):
        in_block = False
        block_indent = 0
        current: list[str] = []
        for line in path.read_text(errors="replace").splitlines():
            stripped = line.strip()
            indent = len(line) - len(line.lstrip())
            if in_block:
                if stripped and indent <= block_indent:
                    in_block = False
                else:
                    continue
            if _RST_DIRECTIVE.match(line) or stripped.endswith("::"):
                in_block, block_indent = True, indent
                if stripped.endswith("::") and not _RST_DIRECTIVE.match(line):
                    current.append(stripped[:-2] + ":")
                continue
            if not stripped or set(stripped) <= set("=-~^*#+|`'\":.") or stripped.startswith((">>>", "|", "+")):
                if current:
                    paras.append(" ".join(current))
                    current = []
                continue
            text = _RST_ROLE.sub(r"\1", stripped).replace("``", "").replace("**", "").replace("*", "")
            current.append(text)
        if current:
            paras.append(" ".join(current))
    return "\n\n".join(p for p in paras if len(p.split()) >= 6 and not p.startswith(("#", "$")))


def fortunes() -> str:
    items: list[str] = []
    for path in sorted(FORTUNES.iterdir()):
        if path.suffix in (".dat", ".u8") or path.is_dir() or path.is_symlink():
            continue
        text = path.read_text(errors="replace")
        for item in re.split(r"^%\s*$", text, flags=re.M):
            words = " ".join(item.split())
            if len(words.split()) >= 4:
                items.append(words)
    return "\n\n".join(items)


def english_words() -> list[str]:
    """SCOWL's American English words to size 80, one a line: the modern and technical words ("organisms",
    "tissue", "apoptosis") that the old books never use. No definitions or examples: nothing of WordNet."""
    return ENGLISH_WORDS.read_text(encoding="utf-8").split()


def wordnet_entries() -> list[tuple[str, list[str], list[str]]]:
    """(pos, lemmas, example sentences) per synset of WordNet 3.0."""
    out = []
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (WORDNET / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith(" "):
                continue
            head, _, gloss = line.partition(" | ")
            fields = head.split()
            count = int(fields[3], 16)
            lemmas = [re.sub(r"\(.*\)$", "", fields[4 + 2 * i]).replace("_", " ") for i in range(count)]
            examples = re.findall(r'"([^"]+)"', gloss)
            out.append((pos, lemmas, examples))
    return out
