"""The environment a user's own Python session needs to load what pipprune registered.

A registered version's files are the final S3 checkpoint (`infra.mlflow_model`), so MLflow's
loaders read them straight from S3: they need the tracking URI, the S3 endpoint
(MLFLOW_S3_ENDPOINT_URL) and read access. The MLflow artifact proxy does not help here: it serves
only `mlflow-artifacts:/` URIs under the server's artifact destination, and checkpoints live in
`runs/` of the pipprune bucket (measured: without keys, `load_model` fails with NoCredentialsError).
"""

from __future__ import annotations

from infra.settings import Settings


class UserEnvError(RuntimeError):
    """The environment cannot be built (e.g. the embedded stack was never started)."""


def user_env(settings: Settings) -> dict[str, str]:
    """Exports for the configured services; for the embedded stack, its endpoints and its S3 keys."""
    from infra.credentials import load_credentials
    from infra.s3store import embedded_s3_url
    from infra.stack import REGION, LocalStack

    if settings.uses_embedded_stack():
        stack = LocalStack(settings)
        keys = load_credentials(stack.dir)
        if keys is None:
            raise UserEnvError(f"no embedded stack under {settings.home}: run `pipprune stack up` first")
        return {**stack.public_env(), "MLFLOW_S3_ENDPOINT_URL": stack.urls["s3"], **keys.as_env(),
                "AWS_DEFAULT_REGION": REGION}
    env: dict[str, str] = {}
    if settings.mlflow_tracking_uri:
        env["MLFLOW_TRACKING_URI"] = env["PIPPRUNE_MLFLOW_TRACKING_URI"] = settings.mlflow_tracking_uri
    if settings.s3_endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = env["PIPPRUNE_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    if settings.prefect_api_url:
        env["PREFECT_API_URL"] = env["PIPPRUNE_PREFECT_API_URL"] = settings.prefect_api_url
    env["PIPPRUNE_S3_BUCKET"] = settings.s3_bucket
    env["AWS_DEFAULT_REGION"] = settings.s3_region
    if settings.s3_endpoint_url == embedded_s3_url(settings):  # the embedded server, named explicitly
        keys = load_credentials(settings.stack_dir)
        if keys is not None:
            env.update(keys.as_env())
    return env
