"""The evaluation kit (infra.eval_kit): built once from Debian's data, cached, at least 30k tokens for a tokenizer,
and found by the evaluate task when a run names the kit's task without an include path."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infra import eval_kit as kit_module
from infra.eval_kit import MIN_TOKENS, WINDOW_WORDS, EvalKitError, eval_kit, kit_tasks_dir, ordered_windows
from infra.reference import sources
from infra.reference.lmeval_tasks import CLOZE_TASK
from tests.helpers import ROOT, bpe_tokenizer

#: where the reference build keeps the janeaustenr .deb: copied into each test home instead of downloaded again
SHARED_DEBS = ROOT / ".pipprune" / "cache" / "debs"


def _install_or_skip() -> None:
    """wordnet-base installed (as root, if missing); skip only when it is absent and cannot be installed."""
    if (sources.WORDNET / "data.noun").is_file():
        return
    try:
        sources.ensure_apt_packages()
    except (sources.MissingDataPackage, subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"Debian's wordnet-base is not installed and cannot be installed here: {exc}")


@pytest.fixture(scope="module")
def kit_home(tmp_path_factory) -> Path:
    _install_or_skip()
    home = tmp_path_factory.mktemp("kit-home")
    if SHARED_DEBS.is_dir():
        shutil.copytree(SHARED_DEBS, home / "cache" / "debs")
    try:
        eval_kit(home)
    except EvalKitError as exc:
        if "r-cran-janeaustenr" in str(exc) and not list((home / "cache" / "debs").glob("*.deb")):
            pytest.skip(f"the janeaustenr .deb cannot be downloaded here: {exc}")
        raise
    return home


@pytest.fixture(scope="module")
def tokenizer(kit_home):
    windows = kit_module._read_jsonl(eval_kit(kit_home).folder / "windows.jsonl")
    return bpe_tokenizer(windows[:40])


def test_the_kit_holds_the_novels_windows_and_the_reference_builds_tasks(kit_home):
    kit = eval_kit(kit_home)
    assert kit.folder.parent == kit_home / "cache" / "eval-kit" and (kit.folder / "kit.json").is_file()
    assert {p.name for p in kit.tasks_dir.glob("*.yaml")} == {f"{CLOZE_TASK}.yaml", "pipprune_persuasion.yaml"}
    assert kit.cloze_task == CLOZE_TASK and (kit.tasks_dir / "wordnet_cloze.jsonl").stat().st_size > 10_000
    windows = kit_module._read_jsonl(kit.folder / "windows.jsonl")
    assert len(windows) == kit.meta["windows"] > 800  # Persuasion is 83k words
    assert all(len(w.split()) == WINDOW_WORDS for w in windows)


def test_a_second_call_does_no_work(kit_home, monkeypatch):
    first = eval_kit(kit_home)

    def no_work(*args, **kwargs):
        raise AssertionError("the kit was built again")

    monkeypatch.setattr(kit_module, "_build", no_work)
    monkeypatch.setattr(sources, "austen_books", no_work)
    assert eval_kit(kit_home) == first


def test_a_build_that_died_is_made_again(kit_home, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(kit_home / "cache", home / "cache")
    kit = eval_kit(home)
    (kit.folder / "kit.json").unlink()  # as a build stopped before its marker leaves it
    (kit.folder / "windows.jsonl").write_text("half")
    rebuilt = eval_kit(home)
    assert kit_module._read_jsonl(rebuilt.folder / "windows.jsonl") == \
        kit_module._read_jsonl(kit_home / "cache" / "eval-kit" / kit.folder.name / "windows.jsonl")


def test_the_general_set_holds_30k_tokens_of_the_tokenizer(kit_home, tokenizer):
    general = eval_kit(kit_home).general_set(tokenizer)
    ids = general.encode(tokenizer)
    predicted = [len(w) - 1 for w in ids]
    assert general.tokens == sum(predicted) >= MIN_TOKENS
    assert sum(predicted[:-1]) < MIN_TOKENS  # the shortest prefix of windows that holds them
    assert general.windows == len(ids) and all(len(w) <= general.max_length for w in ids)
    assert general.sha256 == hashlib.sha256(general.path.read_bytes()).hexdigest()
    assert general.record()["tokens"] == general.tokens and "Persuasion" in general.record()["source"]
    again = eval_kit(kit_home).general_set(tokenizer)
    assert (again.path, again.sha256, again.tokens) == (general.path, general.sha256, general.tokens)


def test_windows_are_whole_words_and_any_prefix_spans_the_text():
    text = " ".join(f"w{i}" for i in range(1000))
    windows = ordered_windows(text, words=10)
    assert sorted(windows) == sorted(" ".join(f"w{i}" for i in range(s, s + 10)) for s in range(0, 1000, 10))
    assert ordered_windows(text, words=10) == windows  # no random generator
    starts = sorted(int(w.split()[0][1:]) for w in windows[:20])
    assert starts[0] < 100 and starts[-1] > 900 and max(b - a for a, b in zip(starts, starts[1:], strict=False)) <= 110


def test_missing_wordnet_names_the_package_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "WORDNET", tmp_path / "no-wordnet")
    with pytest.raises(EvalKitError, match="wordnet-base.*apt-get install -y --no-install-recommends wordnet-base"):
        eval_kit(tmp_path / "home")
    assert not list((tmp_path / "home" / "cache" / "eval-kit").glob("*/kit.json"))


def test_missing_janeaustenr_names_the_package_and_the_command(tmp_path, monkeypatch):
    _install_or_skip()

    def cannot_download(cache_dir):
        raise sources.MissingDataPackage(f"cannot download {sources.AUSTEN_DEB}")

    monkeypatch.setattr(sources, "austen_books", cannot_download)
    with pytest.raises(EvalKitError, match="r-cran-janeaustenr.*apt-get download r-cran-janeaustenr"):
        eval_kit(tmp_path / "home")


def test_kit_task_names_resolve_to_the_kit_and_others_do_not(kit_home):
    from infra.lmeval import unknown_tasks

    folder = kit_tasks_dir((CLOZE_TASK,), kit_home)
    assert folder == eval_kit(kit_home).tasks_dir
    assert unknown_tasks([CLOZE_TASK], folder) == []  # lm-eval finds the task there
    assert kit_tasks_dir(("hellaswag",), kit_home) is None
    with pytest.raises(EvalKitError, match="hellaswag"):
        kit_tasks_dir((CLOZE_TASK, "hellaswag"), kit_home)


def test_evaluate_finds_the_kits_task_without_an_include_path(kit_home, tmp_path, monkeypatch):
    import infra.lmeval
    from infra.config import RuntimeSettings
    from tasks import evaluation
    from tasks.refs import ModelRef

    monkeypatch.setenv("PIPPRUNE_HOME", str(kit_home))
    seen = {}

    def recorded(model_dir, tasks, include_path=None, **kwargs):
        seen.update(tasks=tasks, include_path=include_path)
        return {CLOZE_TASK: {"acc": 0.5}}, {"harness": "lm-eval"}

    monkeypatch.setattr(infra.lmeval, "run_lmeval_recorded", recorded)
    monkeypatch.setattr(evaluation, "load_model", lambda *a, **k: (_Net(), None))
    monkeypatch.setattr(evaluation, "ensure_local", lambda ref: tmp_path)
    ref = ModelRef(local_dir=str(tmp_path), fingerprint="f" * 64, num_params=1)
    result = evaluation.evaluate.fn(ref, (CLOZE_TASK,), None, None, 5, RuntimeSettings())
    assert seen == {"tasks": [CLOZE_TASK], "include_path": eval_kit(kit_home).tasks_dir}
    assert result.results == {CLOZE_TASK: {"acc": 0.5}}
    given = tmp_path / "tasks"
    given.mkdir()
    evaluation.evaluate.fn(ref, (CLOZE_TASK,), str(given), None, 5, RuntimeSettings())
    assert seen["include_path"] == given  # an include path given is used as it is
    assert evaluation.tasks_digest(None, (CLOZE_TASK,)).startswith("eval-kit:")
    assert evaluation.tasks_digest(None, ("hellaswag",)) is None


class _Net:
    """Just enough of a model for `evaluate` to read its device."""

    def parameters(self):
        import torch

        yield torch.zeros(1)


def test_the_kit_build_is_atomic_under_concurrent_callers(kit_home, tmp_path):
    """Two processes asking at once: one builds under the lock, the other reads the finished kit."""
    home = tmp_path / "home"
    (home / "cache").mkdir(parents=True)
    shutil.copytree(kit_home / "cache" / "debs", home / "cache" / "debs")
    shutil.copytree(kit_home / "cache" / "janeaustenr", home / "cache" / "janeaustenr")
    code = "import sys; from pathlib import Path; from infra.eval_kit import eval_kit; print(eval_kit(Path(sys.argv[1])).folder)"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(home)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    folders = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0, 0] and len(folders) == 1
    assert (Path(folders.pop()) / "kit.json").is_file()


def test_general_eval_compares_the_final_model_with_the_dense_figures_on_disk(kit_home, tokenizer, monkeypatch):
    """The dense model is measured once (its per-token NLL and argmax written while it is in hand); the final model
    is compared with that file, the dense model never run again, and the figures are those of both models live."""
    import torch

    from infra.config import RuntimeSettings
    from pip_core.precision import native_for
    from pip_core.token_figures import token_figures
    from tasks import evaluation
    from tasks.models import HANDOFF, save_model
    from tests.helpers import tiny_family_model

    monkeypatch.setenv("PIPPRUNE_HOME", str(kit_home))
    runs = []
    monkeypatch.setattr(evaluation, "token_figures",
                        lambda net, windows, **kw: runs.append(net) or token_figures(net, windows, **kw))
    dense_net, pruned_net = (tiny_family_model("llama", len(tokenizer), seed=s) for s in (0, 1))
    rt = RuntimeSettings(device="cpu", dtype="float32")
    dense = save_model(dense_net, tokenizer, "dense-general", 1)
    before = evaluation.general_eval.fn(dense, rt)
    assert before.metrics["general_ppl_ratio"] == before.metrics["general_top1_agreement"] == 1.0
    assert before.metrics["general_tokens"] == before.heldout["tokens"] >= MIN_TOKENS
    assert list((kit_home / "work" / "general-tokens").glob("*.pt"))
    pruned = save_model(pruned_net, tokenizer, "pruned-general", 1)  # the model in hand now, the dense one dropped
    HANDOFF.drop("reference")
    after = evaluation.general_eval.fn(pruned, rt, reference=dense)
    assert len(runs) == 2 and runs[1] is HANDOFF.get(pruned.fingerprint)[0]  # the dense model was not run again
    general = eval_kit(kit_home).general_set(tokenizer, 256)
    windows = general.encode(tokenizer)
    with torch.no_grad():
        live = token_figures(pruned_net, windows, cpu_bf16=True).against(
            token_figures(dense_net, windows, cpu_bf16=True))
    precision = "bf16 autocast" if native_for("cpu", torch.float32) else "float32"
    assert after.heldout == before.heldout == {**general.record(), "precision": precision}
    assert after.metrics["general_ppl_ratio"] == pytest.approx(live["ppl_ratio"], rel=1e-6)
    assert after.metrics["general_top1_agreement"] == pytest.approx(live["top1_agreement"])
    assert after.metrics["general_ppl_ratio"] != 1.0


def test_bf16_autocast_measures_the_same_ratio_as_fp32_and_only_where_the_cpu_has_it(kit_home, tokenizer):
    """The general set is measured under bf16 autocast on CPUs with native bf16 (pip_core.precision): the ratio
    must agree with fp32 closely; elsewhere (or for a bf16 model) nothing changes."""
    import torch

    from pip_core.precision import native_for, precision_name
    from pip_core.token_figures import token_figures
    from tests.helpers import tiny_family_model

    dense, pruned = (tiny_family_model("llama", len(tokenizer), seed=s) for s in (0, 1))
    windows = eval_kit(kit_home).general_set(tokenizer, 256).encode(tokenizer)[:40]
    exact = token_figures(pruned, windows).against(token_figures(dense, windows))
    fast = token_figures(pruned, windows, cpu_bf16=True).against(token_figures(dense, windows, cpu_bf16=True))
    assert fast["ppl_ratio"] == pytest.approx(exact["ppl_ratio"], rel=5e-3)
    assert fast["top1_agreement"] == pytest.approx(exact["top1_agreement"], abs=0.02)
    assert precision_name("cpu", torch.bfloat16) == "bfloat16" and precision_name("cuda", torch.float32) == "float32"
    assert precision_name("cpu", torch.float32) == ("bf16 autocast" if native_for("cpu", torch.float32) else "float32")
    assert precision_name("cpu", torch.float32, wanted=False) == "float32"
