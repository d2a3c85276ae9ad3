"""The planning options `compress` and `plan` share, written once.

Every option defaults to None ("not given"): the job config model (`infra.config`) fills the rest, so
its defaults are the only ones, and each option's help is read from the field it sets
(`config_help`). `compress` merges the given ones over a config file; `plan` builds the same scoring
and serving groups from them (`scoring`, `serving`) and plans through `infra.budgeting.plan_with`,
the mapping the flow uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from pipprune.commands.common import config_help, fail, validation_message

if TYPE_CHECKING:
    from infra.config import ScoringSettings, ServingSettings


def target() -> Any:
    return typer.Option(None, help=config_help("target"))


def ratio() -> Any:
    return typer.Option(None, help=config_help("ratio", "(plan: with neither --ratio nor --target, memory only)"))


def unit() -> Any:
    return typer.Option(None, help=config_help("scoring.unit"))


def width_mode() -> Any:
    return typer.Option(None, help=config_help("scoring.width_mode"))


def align() -> Any:
    return typer.Option(None, help=config_help("scoring.align"))


def iterations() -> Any:
    return typer.Option(None, help=config_help("scoring.iterations"))


def protect_first() -> Any:
    return typer.Option(None, help=config_help("scoring.protect_first"))


def protect_last() -> Any:
    return typer.Option(None, help=config_help("scoring.protect_last"))


def serve_context() -> Any:
    return typer.Option(None, help=config_help("serving.context"))


def serve_batch() -> Any:
    return typer.Option(None, help=config_help("serving.batch"))


def given(**values: Any) -> dict[str, Any]:
    """The options the user gave (the others are the config model's defaults)."""
    return {k: v for k, v in values.items() if v is not None}


def scoring(**values: Any) -> ScoringSettings:
    """The scoring group from the given options and the config's defaults; a bad value is bad input (exit 2)."""
    from pydantic import ValidationError

    from infra.config import ScoringSettings

    try:
        return ScoringSettings(**given(**values))
    except ValidationError as exc:
        fail("scoring: " + validation_message(exc))


def serving(**values: Any) -> ServingSettings:
    """The serving group (KV cache of a memory target) from the given options and the config's defaults."""
    from pydantic import ValidationError

    from infra.config import ServingSettings

    try:
        return ServingSettings(**given(**values))
    except ValidationError as exc:
        fail("serving: " + validation_message(exc))
