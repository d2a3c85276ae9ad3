"""Helpers shared by test modules: S3 and CLI clients of the test stack, a fault-injecting S3 proxy."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import boto3

from infra.progress import BARS_OFF

ROOT = Path(__file__).resolve().parents[1]
#: `--config` of the tests' CLI compress runs: no serving measurement (test_budget_serving_stack keeps it)
NO_SERVING = ("--config", str(ROOT / "tests" / "configs" / "no_serving.yaml"))


def stack_settings_env(settings) -> dict[str, str]:  # settings: infra.settings.Settings
    """PIPPRUNE_* variables that make a CLI process see the stack of `settings` as its embedded stack."""
    return {"PIPPRUNE_HOME": str(settings.home), "PIPPRUNE_S3_PORT": str(settings.s3_port),
            "PIPPRUNE_MLFLOW_PORT": str(settings.mlflow_port), "PIPPRUNE_PREFECT_PORT": str(settings.prefect_port),
            "PIPPRUNE_S3_AUX_PORT_BASE": str(settings.s3_aux_port_base)}


def s3_of(env: dict[str, str]):  # boto3 clients are untyped
    """A boto3 S3 client with the credentials and endpoint of a client environment of the test stack."""
    return boto3.client("s3", endpoint_url=env["PIPPRUNE_S3_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


#: variables a CLI run sets itself when they are unset: the CLI before importing anything (infra.progress outside a
#: terminal, infra.settings.apply_process_env), libraries as it imports them (lm_eval, sklearn). In-process tests set
#: them in the pytest process too, so unset and this value are the same to a request.
CLI_SETS = {**BARS_OFF, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_XET_HIGH_PERFORMANCE": "1", "KMP_DUPLICATE_LIB_OK": "True"}


class _ForkServerClient:
    """This process's `tests.cli_fork_server`: started on first use, stopped at exit."""

    def __init__(self) -> None:
        import atexit
        import json
        import os
        import tempfile

        self.env = {**os.environ, **CLI_SETS}
        self.files = Path(tempfile.mkdtemp(prefix="pipprune-cli-"))
        self.log = (self.files / "server.log").open("w")
        self.process = subprocess.Popen([sys.executable, "-m", "tests.cli_fork_server"], cwd=ROOT, env=self.env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        atexit.register(self.close)
        ready = json.loads(self.process.stdout.readline() or "{}")
        self.alive, self.set_on_import = "ready" in ready, ready.get("set_on_import", {})
        self.runs = 0

    def differences(self, env: dict[str, str]) -> set[str]:
        """The variables that a fresh process with `env` would import with, and the server did not."""
        from tests.cli_fork_server import LATE_READ

        ours, theirs = {**self.env, **self.set_on_import}, {**self.set_on_import, **env}
        return {k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k) and not k.startswith(LATE_READ)
                and not {theirs.get(k), ours.get(k)} <= {None, CLI_SETS.get(k)}}

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a fresh process with `env` would import exactly what the server imported."""
        return self.alive and not self.differences(env)

    def run(self, env: dict[str, str], args: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess:
        import json

        self.runs += 1
        out, err = self.files / f"{self.runs}.out", self.files / f"{self.runs}.err"
        request = {"args": list(args), "env": env, "cwd": str(ROOT), "stdout": str(out), "stderr": str(err),
                   "timeout": timeout}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline() or '{"lost": true}')
        cmd = [sys.executable, "-m", "pipprune.cli", *args]
        stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
        if reply.get("lost"):
            raise RuntimeError(f"the CLI fork server died: see {self.log.name}")
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)

    def close(self) -> None:
        import shutil

        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.files, ignore_errors=True)


@functools.cache
def _fork_server() -> _ForkServerClient:
    return _ForkServerClient()


def cli(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the `pipprune` CLI as its own process with `env`, capturing its output.

    The process is forked from `tests.cli_fork_server` (imports done once per test process) when `env` differs from
    this process's only in variables read after import; otherwise, or with PIPPRUNE_TEST_FORK_SERVER=0, it is a
    fresh `python -m pipprune.cli`."""
    import os

    if os.environ.get("PIPPRUNE_TEST_FORK_SERVER", "1") != "0":
        server = _fork_server()
        if not server.alive:
            why = f"the CLI fork server did not start (see {server.log.name})"
        elif differences := server.differences(env):
            why = f"{sorted(differences)[:5]} differ from the CLI fork server's environment"
        else:
            return server.run(env, args, timeout)
        import warnings

        warnings.warn(f"`pipprune {args[0] if args else ''}` ran as a fresh process (~14 CPU-s of imports): {why}",
                      stacklevel=2)
    return subprocess.run([sys.executable, "-m", "pipprune.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


class FlakyS3Proxy:
    """A loopback HTTP proxy in front of the S3 server that answers 503 to its first `failures` requests."""

    def __init__(self, upstream: str, failures: int) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlparse

        target = urlparse(upstream)
        proxy = self
        self.failures, self.failed, self.forwarded = failures, 0, 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # silence
                pass

            def _raw_body(self) -> bytes | None:
                """The request body as sent, chunked framing (and trailers) included."""
                if "chunked" not in (self.headers.get("Transfer-Encoding") or ""):
                    length = int(self.headers.get("Content-Length") or 0)
                    return self.rfile.read(length) if length else None
                raw = b""
                while True:
                    line = self.rfile.readline()
                    raw += line
                    size = int(line.split(b";")[0].strip(), 16)
                    if size == 0:
                        while True:
                            trailer = self.rfile.readline()
                            raw += trailer
                            if trailer in (b"\r\n", b"\n", b""):
                                return raw
                    raw += self.rfile.read(size) + self.rfile.readline()

            def _handle(self) -> None:
                body = self._raw_body()
                if proxy.failed < proxy.failures:
                    proxy.failed += 1
                    self.send_response(503)
                    payload = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                proxy.forwarded += 1
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                # the Host header stays the proxy's: SigV4 signed it, and SeaweedFS checks signatures
                headers = dict(self.headers.items())
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()


#: the eight supported families: stock config class and the overrides that exercise each one's
#: peculiarity (head_dim independent of hidden/heads, sliding/full layer_types with a tiny window)
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", {"head_dim": 32, "sliding_window": 4,
                                "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 32, "sliding_window": 4,
                                         "layer_types": ["sliding_attention", "sliding_attention",
                                                         "full_attention", "sliding_attention"]}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
}


def tiny_family_model(model_type: str, vocab_size: int, seed: int = 0, layers: int = 4, **overrides):
    """A small random-init model of `model_type` built from its stock transformers config class."""
    import torch
    import transformers

    config_class, extra = FAMILY_CONFIGS[model_type]
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, config_class)(**{**fields, **extra, **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def bpe_tokenizer(texts: list[str]):
    """A tiny byte-level BPE tokenizer trained on `texts` (pad 0, bos 1, eos 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(texts * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def view_gradients(model, tokenizer, text: str) -> dict[str, torch.Tensor]:  # noqa: F821
    """Parameter name -> gradient of the causal-LM loss of `text` alone: the naive per-view reference for PIP."""
    model.zero_grad()
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def pair_gradients(model, tokenizer, pair: tuple[str, str]) -> list[dict]:
    """The naive per-view gradients of one (original, perturbed) pair."""
    return [view_gradients(model, tokenizer, text) for text in pair]


def unit_view_differences(model, unit, grads: list[dict]):
    """(grad L(s) - grad L(s~), weight) restricted to each tensor slice `unit` owns: what PIP's forms reduce."""
    from pip_core import units

    names = {id(p): n for n, p in model.named_parameters()}
    for tensor, dim, sl in units.unit_slices(model, unit):
        d = (grads[0][names[id(tensor)]] - grads[1][names[id(tensor)]])
        w = tensor.detach()
        yield (d[sl], w[sl]) if dim == 0 else (d[:, sl], w[:, sl])
