"""Bad input matrix: each case exits non-zero with a message naming the problem, before any work."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from typer.testing import CliRunner

from pipprune.cli import app

TEXT = "the host said that the cat sat on the mat later and the ghost would alter the plan"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-input")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    llama.save_pretrained(root / "llama")
    fast.save_pretrained(root / "llama")
    llama.save_pretrained(root / "no-tokenizer")
    BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(root / "bert")
    (root / "good.jsonl").write_text("".join(json.dumps({"text": f"{TEXT} {i}"}) + "\n" for i in range(10)))
    (root / "empty.jsonl").write_text("")
    (root / "binary.jsonl").write_bytes(b"\x00\x01\x02\x03 junk")
    (root / "schema.jsonl").write_text(json.dumps({"body": TEXT}) + "\n")
    (root / "unknown-key.yaml").write_text(f"model: {root / 'llama'}\ncalibration: {root / 'good.jsonl'}\nratoi: 0.2\n")
    (root / "deep.yaml").write_text(f"model: {root / 'llama'}\ncalibration: {root / 'good.jsonl'}\nratio: 0.4\n"
                                    "unit: width\nmethod: magnitude\nprotect_first: 0\nprotect_last: 0\n")
    (root / "nan.yaml").write_text(f"model: {root / 'llama'}\ncalibration: {root / 'good.jsonl'}\nratio: .nan\n")
    return root


def run(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(app, args, env=env)


def compress(workdir: Path, *extra: str, model: str = "llama", calibration: str = "good.jsonl") -> list[str]:
    return ["compress", "--model", str(workdir / model) if "/" not in model else model,
            "--calibration", str(workdir / calibration), *extra]


CASES = {
    "nonexistent path": (lambda w: compress(w, model="/nonexistent/model-dir"), "does not exist"),
    "non-causal model": (lambda w: compress(w, model="bert"), "BertForMaskedLM"),
    "tokenizer missing": (lambda w: compress(w, model="no-tokenizer"), "no tokenizer"),
    "ratio 0": (lambda w: compress(w, "--ratio", "0"), "ratio"),
    "ratio 1": (lambda w: compress(w, "--ratio", "1"), "ratio"),
    "ratio negative": (lambda w: compress(w, "--ratio", "-0.2"), "ratio"),
    "ratio NaN": (lambda w: compress(w, "--ratio", "nan"), "ratio"),
    "iterations 0": (lambda w: compress(w, "--iterations", "0"), "iterations"),
    "ratio that guts the layers": (lambda w: ["compress", "--config", str(w / "deep.yaml")],
                                   "of the decoder layers' parameters"),
    "unknown unit": (lambda w: compress(w, "--unit", "neurons"), "unit"),
    "unknown method": (lambda w: compress(w, "--method", "wanda"), "method"),
    "block influence on mlp": (lambda w: compress(w, "--method", "block-influence", "--unit", "mlp"), "block"),
    "calibration empty": (lambda w: compress(w, calibration="empty.jsonl"), "empty"),
    "calibration binary": (lambda w: compress(w, calibration="binary.jsonl"), "binary"),
    "calibration wrong schema": (lambda w: compress(w, calibration="schema.jsonl"), "no 'text' column"),
    "calibration missing": (lambda w: compress(w, calibration="nope.jsonl"), "not found"),
    "config unknown key": (lambda w: ["compress", "--model", str(w / "llama"), "--config", str(w / "unknown-key.yaml")],
                           "ratoi"),
    "no model and no config": (lambda w: ["compress", "--ratio", "0.2"], "--model is required"),
    "config ratio NaN": (lambda w: ["compress", "--model", str(w / "llama"), "--config", str(w / "nan.yaml")], "ratio"),
    "recovery kind unknown": (lambda w: compress(w, "--recovery", "distill", "--recovery-steps", "5"),
                              "recovery.kind"),
    "calibration weight zero": (lambda w: compress(w, calibration="self:0"), "SOURCE:WEIGHT"),
    "alias invalid": (lambda w: ["promote", "m", "--version", "1", "--alias", "latest"], "alias"),
    "alias with slash": (lambda w: ["promote", "m", "--version", "1", "--alias", "a/b"], "alias"),
    "gates unknown key": (lambda w: ["promote", "m", "--version", "1", "--alias", "ok", "--gates",
                                     str(w / "unknown-key.yaml")], "gate file"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_named_and_refused(workdir, tmp_path, name):
    build, message = CASES[name]
    result = run(build(workdir), env={"PIPPRUNE_HOME": str(tmp_path / "home")})
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert message in result.output, result.output
    # refused before anything ran: no stack state, no work files
    assert not (tmp_path / "home" / "stack").exists()
    assert not (tmp_path / "home" / "work").exists()


def test_invalid_bucket_name_is_refused(workdir, tmp_path):
    result = run(compress(workdir), env={"PIPPRUNE_HOME": str(tmp_path / "home"), "PIPPRUNE_S3_BUCKET": "Bad_Bucket"})
    assert result.exit_code == 2 and "bucket" in result.output
    assert not (tmp_path / "home" / "stack").exists()


class _Denying(BaseHTTPRequestHandler):
    """An S3 endpoint that rejects every credential, like AWS with a wrong secret key."""

    def _deny(self) -> None:
        body = b"<Error><Code>InvalidAccessKeyId</Code><Message>denied</Message></Error>"
        self.send_response(403)
        self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = _deny

    def log_message(self, *args) -> None:
        pass


def test_wrong_credentials_fail_fast_and_register_nothing(workdir, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Denying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"PIPPRUNE_HOME": str(tmp_path / "home"),
               "PIPPRUNE_S3_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}",
               "PIPPRUNE_MLFLOW_TRACKING_URI": "http://127.0.0.1:9/", "PIPPRUNE_PREFECT_API_URL": "http://127.0.0.1:9/api",
               "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "wrong"}
        result = run(compress(workdir), env=env)
    finally:
        server.shutdown()
    assert result.exit_code == 2  # refused credentials are bad input (3 is for unreachable)
    assert "S3 refused the credentials for http://127.0.0.1:" in result.output and "access denied" in result.output
    assert "InvalidAccessKeyId" in result.output  # the server's reason, read with a GET (HEAD has no body)
    assert "AKIAWRONG" not in result.output
    assert not (tmp_path / "home" / "work").exists()


def test_s3_client_signs_with_the_keys_in_the_environment_now(monkeypatch, tmp_path):
    """A process that saw other keys before (the refused-credentials case above, a worker) must not reuse them."""
    from infra.s3store import s3_client
    from infra.settings import Settings

    def access_key() -> str:
        settings = Settings(home=tmp_path, s3_endpoint_url="http://127.0.0.1:9")
        return s3_client(settings)._request_signer._credentials.get_frozen_credentials().access_key

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFIRSTFIRSTFIRST0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "first")
    assert access_key() == "AKIAFIRSTFIRSTFIRST0"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASECONDSECONDSEC0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "second")
    assert access_key() == "AKIASECONDSECONDSEC0"
