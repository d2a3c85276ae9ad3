"""Per-install credentials of the embedded S3 server: random, stored once, readable by the user only.

The first `stack up` creates them; the S3 server, the MLflow server (artifact proxy) and
pipprune's own clients read them from here. They are never logged, tracked or printed by
`stack status` (tests scan for them).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "credentials.json"


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str

    def as_env(self) -> dict[str, str]:
        """The standard AWS variables, for a child process or a client environment."""
        return {"AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key}

    def __repr__(self) -> str:  # never print the secret by accident
        return f"S3Credentials(access_key_id={self.access_key_id[:4]}..., secret_access_key=***)"


def credentials_path(stack_dir: Path) -> Path:
    return stack_dir / FILE_NAME


def load_credentials(stack_dir: Path) -> S3Credentials | None:
    """The install's credentials, or None before the first `stack up`."""
    path = credentials_path(stack_dir)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return S3Credentials(data["access_key_id"], data["secret_access_key"])


def ensure_credentials(stack_dir: Path) -> S3Credentials:
    """Load the install's credentials, creating random ones (file mode 0600) the first time."""
    existing = load_credentials(stack_dir)
    if existing is not None:
        return existing
    stack_dir.mkdir(parents=True, exist_ok=True)
    created = S3Credentials("PP" + secrets.token_hex(9).upper(), secrets.token_urlsafe(30))
    path = credentials_path(stack_dir)
    try:  # O_EXCL: two `stack up` racing cannot both write, and the file is 0600 from its first byte
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_credentials(stack_dir)  # type: ignore[return-value]
    with os.fdopen(fd, "w") as fh:
        json.dump({"access_key_id": created.access_key_id, "secret_access_key": created.secret_access_key}, fh)
    return created
