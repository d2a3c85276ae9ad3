"""Process set-up shared by every command: environment from settings, embedded stack if unconfigured.

Called once at the top of a command, before Prefect or MLflow are imported, because both read
their endpoints from the environment at import/first use.
"""

from __future__ import annotations

import logging
import os

from infra.settings import Settings, apply_process_env

log = logging.getLogger(__name__)


def prepare_runtime(start_stack: bool = True) -> Settings:
    """Apply settings to the process; start (or reuse) the embedded stack for unset endpoints."""
    settings = Settings()
    apply_process_env(settings)
    if start_stack and settings.uses_embedded_stack():
        from infra.stack import LocalStack

        stack = LocalStack(settings)
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
