"""The embedded local stack: an S3-protocol server (moto), an MLflow server and a Prefect server.

All bind 127.0.0.1. Processes are started detached (own session) so `pipprune stack up` can
return while they keep running; their pids live in HOME/stack/state.json so `down` can always
stop every process group it started, and `status` can tell a live service from a stale pid.
moto keeps objects in memory: the embedded default is for demos, CI and trying things out;
teams point PIPPRUNE_S3_ENDPOINT_URL at real S3/MinIO.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.settings import Settings

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
#: moto accepts any credentials; these are only ever sent to the embedded server
EMBEDDED_AWS = {"AWS_ACCESS_KEY_ID": "pipprune-local", "AWS_SECRET_ACCESS_KEY": "pipprune-local",
                "AWS_DEFAULT_REGION": "us-east-1"}


class StackError(RuntimeError):
    """A stack service could not be started or is unhealthy."""


@dataclass
class ServiceStatus:
    name: str
    url: str
    pid: int | None
    up: bool
    log: str


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((HOST, port)) == 0


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie child of this process is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def _group_alive(pgid: int) -> bool:
    """True while any process of the group exists (zombies of our own children excluded by reaping)."""
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return _pid_alive(pgid) or any(
        _pid_alive(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid_of(int(p.name)) == pgid)


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def _http_ok(url: str, expect: str | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback only
            body = response.read(512).decode(errors="replace")
            return response.status == 200 and (expect is None or expect in body)
    except OSError:
        return False


class LocalStack:
    """Start, stop and inspect the three services for one state dir."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dir = settings.stack_dir
        self.state_file = self.dir / "state.json"

    # ------------------------------------------------------------------ wiring
    @property
    def urls(self) -> dict[str, str]:
        s = self.settings
        return {"s3": f"http://{HOST}:{s.s3_port}", "mlflow": f"http://{HOST}:{s.mlflow_port}",
                "prefect": f"http://{HOST}:{s.prefect_port}/api"}

    def client_env(self) -> dict[str, str]:
        """What a client process needs to use this stack."""
        urls = self.urls
        return {"PIPPRUNE_S3_ENDPOINT_URL": urls["s3"], "PIPPRUNE_MLFLOW_TRACKING_URI": urls["mlflow"],
                "PIPPRUNE_PREFECT_API_URL": urls["prefect"], "PIPPRUNE_S3_BUCKET": self.settings.s3_bucket,
                "MLFLOW_TRACKING_URI": urls["mlflow"], "PREFECT_API_URL": urls["prefect"], **EMBEDDED_AWS}

    def _commands(self) -> dict[str, tuple[list[str], dict[str, str], str, str | None]]:
        s, py = self.settings, sys.executable
        mlflow_dir = self.settings.home / "mlflow"
        mlflow_dir.mkdir(parents=True, exist_ok=True)
        base_env = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", **EMBEDDED_AWS}
        return {
            "s3": ([py, "-m", "moto.server", "-H", HOST, "-p", str(s.s3_port)], base_env, self.urls["s3"] + "/", None),
            "mlflow": ([py, "-m", "mlflow", "server", "--host", HOST, "--port", str(s.mlflow_port),
                        "--backend-store-uri", f"sqlite:///{mlflow_dir / 'mlflow.db'}",
                        "--artifacts-destination", f"s3://{s.s3_bucket}/mlflow-artifacts", "--workers", "1"],
                       {**base_env, "MLFLOW_S3_ENDPOINT_URL": self.urls["s3"]}, self.urls["mlflow"] + "/health", "OK"),
            "prefect": ([py, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(s.prefect_port),
                         "--no-ui"],
                        {**base_env, "PREFECT_HOME": str(self.settings.home / "prefect-server"),
                         "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": ""},
                        self.urls["prefect"] + "/health", "true"),
        }

    # ------------------------------------------------------------------ state
    def _read_state(self) -> dict[str, dict]:
        if not self.state_file.is_file():
            return {}
        return json.loads(self.state_file.read_text())

    def _write_state(self, state: dict[str, dict]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    # ------------------------------------------------------------------ commands
    def status(self) -> list[ServiceStatus]:
        state = self._read_state()
        out = []
        for name, (_cmd, _env, health, expect) in self._commands().items():
            entry = state.get(name, {})
            pid = entry.get("pid")
            out.append(ServiceStatus(name=name, url=self.urls[name], pid=pid,
                                     up=_pid_alive(pid) and _http_ok(health, expect),
                                     log=entry.get("log", str(self.dir / f"{name}.log"))))
        return out

    def up(self, wait: bool = True, timeout: float = 180.0) -> list[ServiceStatus]:
        """Start whatever is not running (idempotent), wait until healthy, create the bucket."""
        self.dir.mkdir(parents=True, exist_ok=True)
        state = self._read_state()
        commands = self._commands()
        for name, (cmd, extra_env, health, expect) in commands.items():
            entry = state.get(name, {})
            if _pid_alive(entry.get("pid")):
                continue
            port = int(self.urls[name].split(":")[2].split("/")[0])
            if _port_open(port):
                raise StackError(f"port {port} for {name} is already used by another process; "
                                 f"set PIPPRUNE_{name.upper()}_PORT to a free port")
            log_path = self.dir / f"{name}.log"
            env = {**os.environ, **extra_env}
            env.pop("PYTHONSTARTUP", None)
            with log_path.open("ab") as log_fh:
                proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True, cwd=self.dir)
            state[name] = {"pid": proc.pid, "cmd": cmd, "log": str(log_path), "started_at": time.time()}
            self._write_state(state)
            log.info("started %s (pid %d) on %s", name, proc.pid, self.urls[name])
        if wait:
            self._wait_healthy(timeout)
            self._ensure_bucket()
        return self.status()

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = dict(self._commands())
        state = self._read_state()
        while pending:
            for name, (_cmd, _env, health, expect) in list(pending.items()):
                if _http_ok(health, expect):
                    del pending[name]
                elif not _pid_alive(state[name]["pid"]):
                    tail = Path(state[name]["log"]).read_text(errors="replace")[-2000:]
                    raise StackError(f"{name} exited during start-up; last log lines:\n{tail}")
            if pending and time.monotonic() > deadline:
                raise StackError(f"not healthy after {timeout:.0f}s: {', '.join(pending)} (logs in {self.dir})")
            time.sleep(0.3)

    def _ensure_bucket(self) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.urls["s3"], region_name="us-east-1",
                              aws_access_key_id=EMBEDDED_AWS["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=EMBEDDED_AWS["AWS_SECRET_ACCESS_KEY"])
        names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if self.settings.s3_bucket not in names:
            client.create_bucket(Bucket=self.settings.s3_bucket)

    def down(self, timeout: float = 15.0) -> None:
        """Stop every process group this stack started; SIGKILL what ignores SIGTERM.

        Whole groups are signalled even when their leader already died, because servers such as
        MLflow leave worker children (uvicorn, job consumers) in the leader's group.
        """
        state = self._read_state()
        groups = [entry["pid"] for entry in state.values() if entry.get("pid")]
        for pgid in groups:
            _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for pgid in groups:
            while _group_alive(pgid) and time.monotonic() < deadline:
                _reap(pgid)
                time.sleep(0.2)
            if _group_alive(pgid):
                _signal_group(pgid, signal.SIGKILL)
            _reap(pgid)
        if self.state_file.exists():
            self.state_file.unlink()

    @staticmethod
    def as_dicts(statuses: list[ServiceStatus]) -> list[dict]:
        return [asdict(s) for s in statuses]
