"""Every `pipprune` command line in README.md and docs/ goes through the command line's own parser, so the
documentation cannot drift from the CLI: a command or option that does not exist fails here.

Lines in fenced code blocks are parsed as they stand (a missing required option or a bad value fails too);
inline spans such as `pipprune lineage NAME` often name a command in prose, so they are parsed leniently:
only commands and options that do not exist fail.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer

from pipprune.cli import app, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: fenced blocks in these languages hold no shell command lines
NOT_SHELL = {"python", "yaml", "yml", "json", "toml", "text"}
OPERATORS = set("();<>|&")


@dataclass(frozen=True)
class DocCommand:
    """One `pipprune` invocation found in a document: where, its arguments, and whether it stands as a full line."""

    where: str
    args: tuple[str, ...]
    strict: bool


def invocations(line: str) -> list[list[str]]:
    """The argument lists of every `pipprune` run in one shell line (after `&&`, `|`, `;`, inside `$(...)`)."""
    if not re.search(r"\bpipprune\s", line):
        return []
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found: list[list[str]] = []
    current: list[str] | None = None
    at_start = True
    for token in lexer:
        substitution = re.fullmatch(r"\$\((.*)\)", token, re.S)
        if substitution:  # "$(pipprune stack env)": quoted, so one token
            found += invocations(substitution.group(1))
        elif set(token) <= OPERATORS:
            current, at_start = None, True
        elif current is not None:
            current.append(token)
        elif at_start and (token == "pipprune" or token.endswith("/pipprune")):
            current, at_start = [], False
            found.append(current)
        elif not (at_start and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", token)):  # VAR=value prefixes a command
            at_start = False
    return found


def doc_commands(text: str, name: str) -> Iterator[DocCommand]:
    """Every invocation in a markdown text: fenced shell blocks (continuation lines joined) and inline spans."""
    fence: str | None = None
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        opened = re.match(r"\s*```(\w*)", line)
        if opened:
            fence = None if fence is not None else opened.group(1).lower()
            continue
        if fence is not None:
            if fence in NOT_SHELL:
                continue
            start = start if pending else number  # a command is named by its first line
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            for args in invocations(pending + line):
                yield DocCommand(f"{name}:{start}", tuple(args), strict=True)
            pending = ""
            continue
        for span in re.findall(r"`([^`]+)`", line):
            if re.match(r"\s*(\S*/)?pipprune\s+[a-z]", span):
                for args in invocations(span):
                    yield DocCommand(f"{name}:{number}", tuple(args), strict=False)


def parse(args: tuple[str, ...], strict: bool) -> None:
    """Parse `args` as `pipprune` would, running nothing; raises typer's usage error on a bad line. Leniently,
    only the command and the names of its options are checked (placeholders and missing options pass)."""
    command = typer.main.get_command(app)
    context, name, rest = None, "pipprune", [a for a in args if a != "--debug"]
    while hasattr(command, "resolve_command"):  # a group: `stack`, `reference`, `keys`, the app itself
        context = command.context_class(command, info_name=name, parent=context)
        name, command, rest = command.resolve_command(context, rest)
    context = command.make_context(name, rest if strict else [], parent=context, resilient_parsing=not strict)
    known = {o for p in command.get_params(context) for o in (*p.opts, *p.secondary_opts)}
    for token in rest:
        if token.startswith("-") and token.split("=")[0] not in known:
            raise typer.BadParameter(f"No such option: {token.split('=')[0]}", ctx=context)


def problems(commands: list[DocCommand]) -> list[str]:
    out = []
    for c in commands:
        try:
            parse(c.args, c.strict)
        except typer.TyperException as exc:  # typer's click: NoSuchOption, UsageError, BadParameter
            out.append(f"{c.where}: pipprune {shlex.join(c.args)}: {exc.format_message()}")
    return out


def all_doc_commands() -> list[DocCommand]:
    return [c for path in DOCS for c in doc_commands(path.read_text(), str(path.relative_to(ROOT)))]


def test_every_documented_command_line_parses() -> None:
    found = all_doc_commands()
    assert len({c.args[0] for c in found if c.args}) >= 10  # the walk finds the commands at all
    assert problems(found) == []


def test_a_flag_that_does_not_exist_fails_the_check() -> None:
    text = ("Run it:\n\n```bash\npipprune stack up && pipprune compress --model m.gguf \\\n    --ratio 0.2 --no-such-flag\n"
            "```\n\nor `pipprune lineage NAME --verify-harder` in prose; `pipprune lineage NAME` alone is fine.\n")
    found = list(doc_commands(text, "example.md"))
    assert [(c.where, c.args[0], c.strict) for c in found] == [
        ("example.md:4", "stack", True), ("example.md:4", "compress", True), ("example.md:8", "lineage", False),
        ("example.md:8", "lineage", False)]
    reported = problems(found)
    assert len(reported) == 2
    assert "example.md:4" in reported[0] and "--no-such-flag" in reported[0]
    assert "example.md:8" in reported[1] and "--verify-harder" in reported[1]


def test_fenced_lines_are_parsed_strictly_and_inline_spans_leniently() -> None:
    assert problems([DocCommand("x", ("promote", "NAME"), strict=False)]) == []
    missing = problems([DocCommand("x", ("promote", "NAME"), strict=True)])
    assert len(missing) == 1 and "--version" in missing[0]
    assert problems([DocCommand("x", ("no-such-command",), strict=False)])


def test_invocations_inside_substitutions_and_pipes() -> None:
    assert invocations('eval "$(pipprune stack env)"') == [["stack", "env"]]
    assert invocations("pipprune compress --json --model m | jq . > out.json") == [["compress", "--json", "--model", "m"]]
    assert invocations("PIPPRUNE_HOME=/tmp/h .venv/bin/pipprune stack up  # a comment --bogus") == [["stack", "up"]]
    assert invocations("pip install pipprune") == []


def test_an_unknown_option_exits_2_naming_it(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["compress", "--model", "m", "--no-such-flag"])
    assert exited.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err
