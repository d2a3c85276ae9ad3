"""Process set-up shared by every command: environment from settings, embedded stack if unconfigured.

Called once at the top of a command, before Prefect or MLflow are imported, because both read
their endpoints from the environment at import/first use.
"""

from __future__ import annotations

import logging
import os
import sys

from infra.settings import Settings, apply_process_env

log = logging.getLogger(__name__)


class StackDown(RuntimeError):
    """The embedded stack is needed, is not running, and auto-start is off."""


def prepare_runtime(start_stack: bool = True, auto_stack: bool | None = None) -> Settings:
    """Apply settings to the process; use (or start) the embedded stack when no endpoint is configured.

    Starting it is said on stderr first, since it leaves three servers running after the command;
    with auto-start off (`auto_stack=False`, PIPPRUNE_AUTO_STACK=false) a stopped stack raises
    `StackDown` instead. A configured (remote) endpoint never starts anything.
    """
    settings = Settings()
    apply_process_env(settings)
    if start_stack and settings.uses_embedded_stack():
        from infra.stack import LocalStack

        stack = LocalStack(settings)
        if not all(s.up for s in stack.status()):
            if not (settings.auto_stack if auto_stack is None else auto_stack):
                raise StackDown(f"the embedded stack in {settings.home} is not running and auto-start is off "
                                "(--no-auto-stack / PIPPRUNE_AUTO_STACK=false): run `pipprune stack up`, or set "
                                "PIPPRUNE_S3_ENDPOINT_URL, PIPPRUNE_MLFLOW_TRACKING_URI and PIPPRUNE_PREFECT_API_URL "
                                "to running services")
            print(f"starting the embedded stack in {settings.home} (stop: pipprune stack down)", file=sys.stderr,
                  flush=True)
            stack.up(wait=True)
        os.environ.update(stack.client_env())
        settings = Settings()
        apply_process_env(settings)
    return settings


def prefect_settings():  # noqa: ANN201
    """Prefect settings for the API URL now in the environment.

    Prefect reads its settings when first imported; a command that imported it before
    `prepare_runtime` set PREFECT_API_URL would otherwise start a throwaway local server.
    """
    from contextlib import nullcontext

    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = os.environ.get("PREFECT_API_URL")
    return temporary_settings(updates={PREFECT_API_URL: url}) if url else nullcontext()
