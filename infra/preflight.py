"""Checks run before a compress job touches any server: bad input fails in seconds, by name.

Nothing is started, tracked or registered when these fail, so a typo never leaves a
half-written run behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from infra.config import BUILTIN_CLOZE_TASK, CompressConfig
from infra.settings import Settings

if TYPE_CHECKING:
    from pip_core.budget import BudgetPlan


class PreflightError(ValueError):
    """An input or a service is not usable; the message says which and why."""


class ServiceUnreachable(PreflightError):
    """A service (S3, MLflow, Prefect) did not answer: not the input's fault (exit code 3, not 2)."""


def check_inputs(config: CompressConfig) -> BudgetPlan:
    """Model directory, architecture, tokenizer, calibration file, budget, memory: all before any work. Returns
    the budget's plan (what the target takes from the decoder layers is said before the run starts)."""
    from infra.calibration import CalibrationSource, load_calibration
    from infra.model_source import local_model_dir
    from pip_core import io as core_io
    from pip_core.placement import plan_placement, resolve_device

    resolve_device(config.runtime.device)  # a missing GPU is refused before anything else is read
    local = local_model_dir(config.model)
    model_config = core_io.check_loadable(local)
    core_io.check_tokenizer(local)
    spec = config.calibration.spec
    for name in spec.files:
        load_calibration(CalibrationSource(name, config.calibration.wordlist if spec.single_file else None).path)
    if config.calibration.wordlist and not Path(config.calibration.wordlist).expanduser().is_file():
        raise FileNotFoundError(f"word list not found: {config.calibration.wordlist}")
    named = tuple(t for t in config.evaluation.tasks  # the built-in kit's task is built at run time (tasks.evaluation)
                  if config.evaluation.include_path or t != BUILTIN_CLOZE_TASK)
    if named:
        check_eval_tasks(named, config.evaluation.include_path)
    vocab_after = check_vocab(config, local) if config.vocab.enabled else None
    budget = check_budget(config, model_config, vocab_after)  # no weights read: an infeasible target fails in seconds
    check_weights_intact(local)
    core_io.check_weights(local, model_config)
    placement = plan_placement(model_config, config.runtime.device, config.runtime.dtype,
                               seq_len=config.calibration.max_length)
    if not placement.fits:
        raise PreflightError(f"{config.model} {placement.describe()} ({placement.plan.weights / 2**30:.1f} GiB "
                             "weights); see `pipprune plan`")
    return budget


def check_vocab(config: CompressConfig, local: Path) -> int:
    """The tokens the vocabulary corpus keeps (the tokenizer and the corpus read, no weights); a missing corpus file
    or a tokenizer the trim cannot rewrite is refused by name."""
    from infra.budgeting import kept_tokens
    from infra.vocab_source import VocabSourceError
    from pip_core.errors import PipCoreError

    try:
        return kept_tokens(local, config.vocab.corpus)
    except (VocabSourceError, PipCoreError) as exc:
        raise PreflightError(f"vocab corpus {config.vocab.corpus!r}: {exc}") from None


def check_budget(config: CompressConfig, model_config: dict, vocab_after: int | None = None) -> BudgetPlan:
    """Refuse a target the run cannot meet, naming the nearest feasible one (pip_core.budget), and one that guts
    the decoder layers unless the config confirms it (`allow_deep_cut`); the plan otherwise. `vocab_after`: the
    vocabulary is trimmed to that many tokens first (its rows count towards the target)."""
    from infra.budgeting import deep_cut_refusal, plan_for, refusal
    from pip_core.budget import BudgetError

    try:
        plan = plan_for(config, model_config, vocab_after)
    except BudgetError as exc:
        raise PreflightError(refusal(exc)) from None
    if plan.body.deep and not config.allow_deep_cut:
        raise PreflightError(deep_cut_refusal(plan))
    return plan


def _check_health(url: str, name: str, setting: str) -> None:
    """`url`/health must answer 200 within a few seconds; else the service is unreachable (exit 3)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as response:  # noqa: S310
            if response.status == 200:
                return
    except OSError as exc:
        raise ServiceUnreachable(f"cannot reach {name} at {url}: {exc}; start it, or fix {setting}") from exc
    raise ServiceUnreachable(f"{name} at {url} is not healthy")


def check_mlflow(uri: str | None) -> None:
    """An HTTP tracking server must answer its health check (bounded: a few seconds)."""
    if uri and uri.startswith(("http://", "https://")):
        _check_health(uri, "MLflow", "PIPPRUNE_MLFLOW_TRACKING_URI")


def check_prefect(url: str | None) -> None:
    """A Prefect API server, when one is configured, must answer its health check."""
    if url:
        _check_health(url, "the Prefect API", "PIPPRUNE_PREFECT_API_URL")


def _refusal(client, bucket: str) -> str:  # noqa: ANN001 - boto3 client
    """The server's reason for a 403: HEAD responses carry no body, so ask once more with a GET."""
    import botocore.exceptions as bce

    try:
        client.list_objects_v2(Bucket=bucket, MaxKeys=1)
    except bce.ClientError as exc:
        error = exc.response.get("Error", {})
        return f"{error.get('Code', '403')} ({error.get('Message', 'Forbidden')}), access denied"
    except bce.BotoCoreError as exc:
        return f"403 ({type(exc).__name__}), access denied"
    return "403 on HeadBucket, access denied"


def check_mlflow_artifacts(uri: str) -> None:
    """The MLflow server's artifact proxy can list its store: a proxy whose S3 keys are refused fails
    here, in a second, instead of at the first plot after minutes of scoring."""
    import json
    import urllib.error
    import urllib.request

    url = uri.rstrip("/") + "/api/2.0/mlflow-artifacts/artifacts?path="
    try:
        with urllib.request.urlopen(url, timeout=30):  # noqa: S310 - the configured tracking server
            return
    except urllib.error.HTTPError as exc:
        body = exc.read(2000).decode(errors="replace")
        if exc.code == 404 and "mlflow-artifacts" not in body:  # a server that does not proxy artifacts
            return
        try:
            reason = json.loads(body).get("message", body)
        except ValueError:
            reason = body
        if exc.code in (401, 403) or any(c in body for c in ("InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                              "AccessDenied")):
            raise PreflightError(f"the MLflow server at {uri} cannot store artifacts: S3 refused its credentials "
                                 f"({reason[:300]}); restart it with the right keys (embedded stack: "
                                 "`pipprune stack down && pipprune stack up`)") from exc
        raise PreflightError(f"the MLflow server at {uri} cannot list its artifact store: HTTP {exc.code} "
                             f"{reason[:300]}") from exc
    except OSError as exc:
        raise PreflightError(f"cannot reach MLflow at {uri}: {exc}") from exc


def check_services(settings: Settings) -> None:
    """The bucket exists and the credentials may use it; MLflow answers."""
    import os

    import botocore.exceptions as bce

    from infra.s3store import s3_client

    client = s3_client(settings)
    where = settings.s3_endpoint_url or "AWS S3"
    try:
        client.head_bucket(Bucket=settings.s3_bucket)
    except bce.NoCredentialsError as exc:
        raise PreflightError(f"no AWS credentials found for {where}: set AWS_ACCESS_KEY_ID/"
                             "AWS_SECRET_ACCESS_KEY or AWS_PROFILE") from exc
    except bce.ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 404:
            raise PreflightError(f"S3 bucket {settings.s3_bucket!r} does not exist at {where}") from exc
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch") or status in (401, 403):
            raise PreflightError(f"S3 refused the credentials for {where}: {_refusal(client, settings.s3_bucket)} "
                                 "(check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; the embedded stack's keys are in "
                                 f"{settings.stack_dir / 'credentials.json'})") from exc
        raise PreflightError(f"S3 bucket {settings.s3_bucket!r} at {where}: {exc}") from exc
    except (bce.EndpointConnectionError, bce.ConnectTimeoutError) as exc:
        raise ServiceUnreachable(f"cannot reach S3 at {where}: {exc}; start it, or fix PIPPRUNE_S3_ENDPOINT_URL") \
            from exc
    uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    check_mlflow(uri)
    if uri and uri.startswith(("http://", "https://")):
        check_mlflow_artifacts(uri)
    check_prefect(settings.prefect_api_url or os.environ.get("PREFECT_API_URL"))
    check_signing_key(settings)


def check_signing_key(settings: Settings) -> None:
    """The key that will sign the registered model loads (a compress run must not fail at its last step)."""
    from infra.signing import SigningError, resolve_signing_key

    try:
        resolve_signing_key(settings)
    except SigningError as exc:
        raise PreflightError(str(exc)) from exc


def check_weights_intact(model_dir: Path) -> None:
    """Every safetensors file is as long as its header says: a truncated copy is named before any load."""
    import json
    import struct

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        fix = "re-download or re-copy the model"
        try:
            with path.open("rb") as fh:
                (header_len,) = struct.unpack("<Q", fh.read(8))
                if header_len > min(size - 8, 100 * 2**20):
                    raise PreflightError(f"{path} is truncated or not a safetensors file (header length "
                                         f"{header_len} bytes, file {size} bytes); {fix}")
                header = json.loads(fh.read(header_len))
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            if isinstance(exc, PreflightError):
                raise
            raise PreflightError(f"{path} is truncated or corrupt (unreadable safetensors header: {exc}); {fix}") \
                from exc
        ends = [entry["data_offsets"][1] for name, entry in header.items()
                if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
        expected = 8 + header_len + max(ends, default=0)
        if size != expected:
            raise PreflightError(f"{path} is truncated or corrupt: its header describes {expected:,} bytes but the "
                                 f"file has {size:,}; {fix}")


def check_eval_tasks(tasks: tuple[str, ...], include_path: str | None) -> None:
    """Every evaluation task exists, found before calibration, scoring and pruning rather than after."""
    from infra.lmeval import unknown_tasks

    if include_path is not None and not Path(include_path).is_dir():
        raise PreflightError(f"lm-eval include path not found: {include_path} (--include-path / "
                             "evaluation.include_path)")
    unknown = unknown_tasks(list(tasks), include_path)
    if unknown:
        where = f"in {include_path} or " if include_path else ""
        raise PreflightError(f"unknown lm-eval task(s) {', '.join(unknown)}: not {where}in lm-eval's task registry; "
                             "fix --tasks (evaluation.tasks), or point --include-path at the task YAMLs")
