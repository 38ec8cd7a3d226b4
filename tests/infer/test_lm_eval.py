"""The `grt` model of lm-evaluation-harness, and the harness' own `--model hf` on the Hugging
Face export: offline, on local task files, their numbers equal `grt eval`'s on the same
examples (the same requests, the same scoring)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import OFFLINE, SHARED
from trained_models import ENV, REPO, torch_trained_grt, write_export

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from pretrain.infer.evaluation.lm_eval_model import GRTLM  # noqa: E402
from pretrain.infer.evaluation.zero_shot import encode_request, evaluate_task, score_requests  # noqa: E402
from pretrain.infer.generate import generate  # noqa: E402
from pretrain.runs.eval_tasks import TASKS, load_task  # noqa: E402

EVAL = SHARED / "data" / "eval"
LIMIT = 24


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    model, manifest = torch_trained_grt()
    return write_export(model, tmp_path_factory.mktemp("lm-eval") / "grt", tokenizer=manifest.parents[1] / "tok.model")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    if not (EVAL / "piqa.jsonl").exists():
        pytest.skip(f"{EVAL} not found (set GRT_SHARED_DIR)")
    d = tmp_path_factory.mktemp("tasks")
    for name, placeholder, file in (
        ("piqa_local", "PIQA_FILE", "piqa.jsonl"),
        ("lambada_local", "LAMBADA_FILE", "lambada_openai.jsonl"),
        ("arc_easy_local", "ARC_EASY_FILE", "arc_easy.jsonl"),
    ):
        text = (REPO / "tests" / "lm_eval_tasks" / f"{name}.yaml").read_text()
        (d / f"{name}.yaml").write_text(text.replace(placeholder, str(EVAL / file)))
    return d


pytestmark = pytest.mark.usefixtures("offline")  # every test: no hub


def _grt_eval(export, task, depth):
    lm = GRTLM(path=str(export))
    items = load_task(task, EVAL / TASKS[task].file, limit=LIMIT)
    return evaluate_task(lm.model, lm.tok, items, [depth], lm.device)[depth]


def test_harness_accuracy_equals_grt_eval(export, tasks):
    depth = 2
    out = simple_evaluate(
        model="grt",
        model_args=f"path={export},depth={depth}",
        tasks=["piqa_local", "lambada_local"],
        limit=LIMIT,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
    )["results"]
    assert out["piqa_local"]["acc,none"] == pytest.approx(_grt_eval(export, "piqa", depth)["acc"], abs=1e-12)
    assert out["lambada_local"]["acc,none"] == pytest.approx(_grt_eval(export, "lambada", depth)["acc"], abs=1e-12)


def _requests(kind, args_list):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in args_list]


def test_loglikelihood_and_rolling_score_like_grt_eval(export):
    lm = GRTLM(path=str(export), depth=2)
    pairs = [("The king said", " nothing"), ("To be, or not", " to be")]
    got = lm.loglikelihood(_requests("loglikelihood", pairs))
    enc = [encode_request(lm.tok, c, x, lm.max_len) for c, x in pairs]
    ll, greedy = score_requests(lm.model, enc, [2], lm.device)
    assert got == [(float(a), bool(b)) for a, b in zip(ll[:, 0].tolist(), greedy[:, 0].tolist())]

    short = "First Citizen: Before we proceed any further, hear me speak."
    ids = lm.tok.encode(short)
    assert len(ids) < lm.max_len
    (rolled,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(short,)]))
    whole, _ = score_requests(lm.model, [([lm.tok.sep_id] + ids, len(ids))], [2], lm.device)
    assert rolled == pytest.approx(whole[0, 0].item(), rel=1e-9)
    # longer than the context: windows, every token scored once
    long_text = " ".join([short] * 6)
    n_tokens = len(lm.tok.encode(long_text))
    assert n_tokens > 2 * lm.max_len
    seen = []
    real = lm._score
    lm._score = lambda enc: seen.extend(n for _, n in enc) or real(enc)
    (rolled_long,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(long_text,)]))
    assert sum(seen) == n_tokens and rolled_long < rolled


@pytest.mark.parametrize("kv_cache", [None, "average"])
def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(export, kv_cache):
    lm = GRTLM(path=str(export), depth=3, kv_cache=kv_cache)
    context = "ROMEO:"
    ids = [lm.tok.sep_id] + lm.tok.encode(context)
    new = generate(
        lm.model,
        torch.tensor([ids]),
        20,
        strategy=kv_cache or "full",
        n_loops=3,
        use_cache=kv_cache is not None,
        greedy=True,
        stop_id=lm.tok.sep_id,
    )
    full_text = lm.tok.decode([t for t in new[0].tolist() if t != lm.tok.sep_id])
    assert full_text.strip(), "the model generated nothing to cut"
    stop = full_text.strip()[:2]
    (out,) = lm.generate_until(_requests("generate_until", [(context, {"until": [stop], "max_gen_toks": 20})]))
    assert out == full_text.split(stop, 1)[0]
    (whole,) = lm.generate_until(_requests("generate_until", [(context, {"until": [], "max_gen_toks": 20})]))
    assert whole == full_text


def test_bad_kv_cache_argument_is_one_line(export):
    from grt_common.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_cache='middle'"):
        GRTLM(path=str(export), kv_cache="middle")


@pytest.mark.slow
def test_grt_lm_eval_command_runs_offline(export, tasks, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.cli",
            "lm-eval",
            "--model",
            "grt",
            "--model_args",
            f"path={export},depth=3,kv_cache=average",
            "--tasks",
            "lambada_local",
            "--include_path",
            str(tasks),
            "--limit",
            "8",
            "--output_path",
            str(out),
        ],
        cwd=REPO,
        env={**ENV, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = list(out.rglob("results_*.json"))
    acc = json.loads(results.read_text())["results"]["lambada_local"]["acc,none"]
    lm = GRTLM(path=str(export), depth=3, kv_cache="average")
    items = load_task("lambada", EVAL / "lambada_openai.jsonl", limit=8)
    assert acc == pytest.approx(evaluate_task(lm.model, lm.tok, items, [3], lm.device, kv_cache="average")[3]["acc"])


@pytest.fixture(scope="module")
def hf_export(export) -> Path:
    """The export's hf/ directory, as `grt export` writes it."""
    from pretrain.infer.hf_export import save_hf

    model, _ = torch_trained_grt()
    save_hf(model, export / "hf", export / "tokenizer.model")
    return export / "hf"


@pytest.mark.slow
def test_plain_lm_eval_on_the_hf_export_equals_grt_eval(export, hf_export, tasks, tmp_path):
    """`lm_eval --model hf --model_args pretrained=<export>/hf,trust_remote_code=True,depth=2`, the
    harness' own command and model class: its accuracies equal grt eval's at depth 2, and so does
    every LAMBADA log-likelihood (the depth reached the model: the trained R is 3)."""
    depth, out = 2, tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={hf_export},trust_remote_code=True,depth={depth}",
            "--tasks",
            "arc_easy_local,lambada_local",
            "--include_path",
            str(tasks),
            "--limit",
            str(LIMIT),
            "--device",
            "cpu",
            "--output_path",
            str(out),
            "--log_samples",
        ],
        cwd=tmp_path,
        env={**ENV, **OFFLINE, "HF_MODULES_CACHE": str(tmp_path / "modules")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = list(out.rglob("results_*.json"))
    acc = {task: r["acc,none"] for task, r in json.loads(results.read_text())["results"].items()}
    assert acc["arc_easy_local"] == pytest.approx(_grt_eval(export, "arc_easy", depth)["acc"], abs=1e-12)
    assert acc["lambada_local"] == pytest.approx(_grt_eval(export, "lambada", depth)["acc"], abs=1e-12)
    (samples,) = list(out.rglob("samples_lambada_local_*.jsonl"))
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
    assert len(rows) == LIMIT
    lm = GRTLM(path=str(export))
    enc = [encode_request(lm.tok, r["doc"]["context"], " " + r["doc"]["continuation"], lm.max_len) for r in rows]
    ours, _ = score_requests(lm.model, enc, [depth], lm.device)
    theirs = torch.tensor([float(r["resps"][0][0][0]) for r in rows], dtype=torch.float64)
    assert (theirs - ours[:, 0]).abs().max().item() < 1e-3
