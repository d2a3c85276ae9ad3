"""Byte-compile, once at install, the modules a pipprune run and the local stack import.

`make install` runs pip with --no-compile (compiling every module of torch, transformers, MLflow and Prefect took
127 s of a 169 s install), so Python compiles a module the first time a process imports it and caches the bytecode.
On a fresh clone the first runs then compile the same thousands of modules, in many processes at once: the test
suite's first run on a clean clone took 983 s against 659 s for the next run in the same clone. Importing them
here, in one process, writes that cache once (`python -m pipprune.precompile`).
"""

from __future__ import annotations

import importlib
import logging
import time

log = logging.getLogger(__name__)

#: what a compress run imports inside its functions (pipprune imports its heavy libraries where it uses them, so a
#: light command stays light), after `flows.compress` and `pipprune.cli` (measured on a tiny-model compress: 1,662
#: modules imported after those two without this list, 142 with it)
RUN_IMPORTS = ("mlflow", "mlflow.entities", "mlflow.data", "mlflow.models", "mlflow.pyfunc", "mlflow.transformers",
               "mlflow.system_metrics.system_metrics_monitor", "lm_eval", "lm_eval.evaluator", "lm_eval.loggers",
               "lm_eval.tasks", "lm_eval.models.huggingface", "peft", "boto3", "boto3.s3.transfer", "botocore.config",
               "pandera.typing.dask", "pandera.backends.pandas.register", "pandera.accessors.pandas_accessor",
               "pandera.strategies", "psutil", "gguf", "safetensors.torch", "model_signing.signing",
               "model_signing.verifying", "transformers.models.llama.modeling_llama", "infra.plots",
               "prefect.deployments", "prefect.concurrency.sync", "prefect.client.orchestration", "prefect.flow_engine",
               "prefect.task_engine", "prefect.utilities.visualization", "pandera.api.geopandas", "scipy.io",
               "matplotlib.backends.backend_agg", "mlflow.tracking.request_header.registry")
#: what the local stack's servers import (`pipprune stack up`: the Prefect and MLflow servers)
STACK_IMPORTS = ("prefect.server.api.server", "mlflow.server", "uvicorn")


def import_run_modules() -> None:
    """Import what a compress run imports (the CLI, the flow and RUN_IMPORTS)."""
    import flows.compress  # noqa: F401
    import pipprune.cli  # noqa: F401

    for name in RUN_IMPORTS:
        importlib.import_module(name)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    import_run_modules()
    for name in STACK_IMPORTS:
        importlib.import_module(name)
    log.info("byte-compiled the modules a run and the stack import in %.0f s", time.perf_counter() - start)


if __name__ == "__main__":
    main()
