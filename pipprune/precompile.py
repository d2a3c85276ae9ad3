"""Byte-compile, once at install, the modules a pipprune run, its optional runtimes and the local stack import.

`make install` runs pip with --no-compile (compiling every module of torch, transformers, MLflow and Prefect took
127 s of a 169 s install), so nothing in the virtual environment has bytecode, and every process compiles each module
it imports. Python writes that bytecode back only where PYTHONDONTWRITEBYTECODE is unset; where it is set (as on this
machine) every one of the suite's hundreds of processes compiles the same thousands of modules again: a
clean clone's first suite took 859 s of pytest, the next run in the same clone (whose bytecode one child process
without the variable had written) 633 s. So this module imports what those processes import, then writes the
bytecode of every imported module that lies in the virtual environment, as pip's own compile step would have,
whatever the variable says (it governs imports; the source tree keeps following it). `python -m pipprune.precompile`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import py_compile
import sys
import time
from pathlib import Path

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
#: what the optional runtimes a run can start import: Dask workers for scoring and evaluation, a Prefect process
#: worker for scheduled deployments, MLflow's scoring server for a registered version
RUNTIME_IMPORTS = ("distributed", "prefect_dask", "prefect.workers.process", "mlflow.pyfunc.scoring_server")


def import_run_modules() -> None:
    """Import what a compress run imports (the CLI, the flow and RUN_IMPORTS)."""
    import flows.compress  # noqa: F401
    import pipprune.cli  # noqa: F401

    for name in RUN_IMPORTS:
        importlib.import_module(name)


def compile_imported(root: Path) -> int:
    """Write the missing bytecode of every imported module whose source lies under `root`; returns how many."""
    written = 0
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if not source or not source.endswith(".py") or not Path(source).resolve().is_relative_to(root):
            continue
        if not Path(importlib.util.cache_from_source(source)).is_file():
            written += py_compile.compile(source, doraise=False, quiet=2) is not None
    return written


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    import_run_modules()
    for name in STACK_IMPORTS + RUNTIME_IMPORTS:
        importlib.import_module(name)
    venv = Path(sys.prefix).resolve()
    written = compile_imported(venv)
    log.info("byte-compiled %d modules under %s that a run, its runtimes and the stack import in %.0f s", written,
             venv, time.perf_counter() - start)


if __name__ == "__main__":
    main()
