"""`grt eval`: each metric against a value computed by hand on a few examples."""

import json
import math
import subprocess
import sys

import pytest
import torch
from trained_models import (  # noqa: F401 (fixtures: grt_run, manifest, single_thread)
    ENV,
    EVAL_BATCHES,
    REPO,
    CharTokenizer,
    grt_run,
    manifest,
    single_thread,
    small_model,
    summary,
)

from grt_common.errors import ConfigError
from pretrain.distributed import Dist
from pretrain.infer.evaluation.evaluate import main as eval_main
from pretrain.infer.evaluation.loss_by_depth import text_eval, text_windows
from pretrain.infer.evaluation.scoring import exit_logits, lm_sums
from pretrain.infer.evaluation.zero_shot import encode_request, evaluate_task, score_requests
from pretrain.infer.exit_depths import check_depths
from pretrain.runs.eval_tasks import Item, load_task, parse_depths

CPU = torch.device("cpu")


def test_exit_depths_are_the_models_forward():
    model = small_model()
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    depths = [0, 1, 2, 3, 5]  # 5 is beyond the trained R = 3
    got = exit_logits(model, idx, depths)
    for r in depths:
        assert torch.allclose(got[r], model(idx, n_loops=r).logits, atol=1e-5), r
    assert not torch.allclose(got[0], got[3], atol=1e-3)
    dense = small_model("3", variant="dense")
    assert torch.allclose(exit_logits(dense, idx, [0])[0], dense(idx).logits, atol=1e-5)


@pytest.mark.parametrize("variant", ["huginn", "rrt", "ouro", "mor"])
def test_exit_depths_of_the_baselines(variant):
    """The comparison baselines expose their loop states too: grt eval scores them by depth."""
    from pretrain.model import build_model
    from pretrain.presets import get_preset

    model = build_model(get_preset(f"micro-{variant}")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)  # Huginn draws its initial state
    got = exit_logits(model, idx, [0, 1, 3])
    for r in (0, 1, 3):
        torch.manual_seed(0)
        assert torch.allclose(got[r], model(idx, n_loops=r).logits, atol=1e-5), r
    assert not torch.allclose(got[1], got[3], atol=1e-4)


def test_depth_parsing_and_refusal():
    assert parse_depths("0-3,6", 4) == [0, 1, 2, 3, 6]
    assert parse_depths(None, 4) == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigError, match="expected e.g."):
        parse_depths("a-b", 4)
    model = small_model()
    assert check_depths(model, [0, 3], False) == [0, 3]
    with pytest.raises(ConfigError, match="--allow-beyond-trained"):
        check_depths(model, [0, 4], False)
    assert check_depths(model, [4, 12], True) == [4, 12]


def test_lm_loss_is_the_token_mean_of_the_cross_entropy():
    model = small_model()
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 64, (2, 10), generator=g)
    targets = torch.randint(0, 64, (2, 10), generator=g)
    targets[1, :4] = -100  # not scored
    sums = lm_sums(model, [{"input_ids": idx, "targets": targets}], [0, 2], CPU)
    for i, r in enumerate([0, 2]):
        logp = model(idx, n_loops=r).logits.log_softmax(-1)
        by_hand = -sum(logp[b, t, targets[b, t]].item() for b in range(2) for t in range(10) if targets[b, t] >= 0)
        assert sums[i, 0].item() == pytest.approx(by_hand, rel=1e-5)
        assert sums[i, 1].item() == 16


@pytest.mark.parametrize("n,window,stride", [(11, 4, None), (11, 4, 2), (30, 8, 3), (5, 8, None)])
def test_text_windows_score_every_token_once(n, window, stride):
    spans = text_windows(n, window, stride)
    scored = [i for b, e, first in spans for i in range(first, e)]
    assert scored == list(range(n - 1))
    assert all(e - b <= window for b, e, _ in spans)
    assert text_windows(11, 4) == [(0, 4, 0), (4, 8, 4), (8, 10, 8)]
    assert text_windows(11, 4, 2)[:3] == [(0, 4, 0), (2, 6, 4), (4, 8, 6)]


@pytest.mark.parametrize("window,stride", [(64, None), (32, 16)])
def test_bits_per_byte_by_hand(window, stride):
    """bpb = summed NLL of every token after the separator / ln 2 / UTF-8 bytes; with a stride,
    each token is scored once, with the context of the window that scores it."""
    model, tok = small_model(), CharTokenizer()
    text = "To be, or not to be: that is the question. Ünïcode: ✓"
    ids = [tok.sep_id] + tok.encode(text)
    out = text_eval(model, tok, text, [0, 3], CPU, batch_size=2, dist=Dist(), window=window, stride=stride)
    hand_windows = [(0, len(ids) - 1, 0)] if stride is None else [(0, 32, 0), (16, 48, 32), (32, 53, 48)]
    for r in (0, 3):
        nll = 0.0
        for b, e, first in hand_windows:
            logp = model(torch.tensor([ids[b:e]]), n_loops=r).logits.log_softmax(-1)[0]
            nll -= sum(logp[t - b, ids[t + 1]].item() for t in range(first, e))
        assert out[r]["tokens"] == len(text) == 53
        assert out[r]["bytes"] == len(text.encode("utf-8")) > len(text)
        assert out[r]["bpb"] == pytest.approx(nll / math.log(2) / len(text.encode("utf-8")), rel=1e-5)
        assert out[r]["ppl"] == pytest.approx(math.exp(nll / len(text)), rel=1e-5)


def _loglik_by_hand(model, tok, context, continuation, r):
    ctx, cont = [tok.sep_id] + tok.encode(context), tok.encode(continuation)
    full = ctx + cont
    logp = model(torch.tensor([full[:-1]]), n_loops=r).logits.log_softmax(-1)[0]
    return sum(logp[len(ctx) - 1 + j, cont[j]].item() for j in range(len(cont)))


def test_multiple_choice_sums_continuation_log_likelihoods_by_hand():
    model, tok = small_model(), CharTokenizer()
    item = Item([("The cat sat on the", " mat."), ("The cat sat on the", " extraordinarily long rug.")], gold=1)
    items = [item, Item([("Q: 2+2?\nAnswer:", " 4"), ("Q: 2+2?\nAnswer:", " five")], gold=0)]
    depths = [0, 3]
    res = evaluate_task(model, tok, items, depths, CPU, batch_size=3)
    for r in depths:
        correct = correct_norm = 0
        for it in items:
            ll = [_loglik_by_hand(model, tok, c, x, r) for c, x in it.requests]
            norm = [v / len(x) for v, (_, x) in zip(ll, it.requests)]
            correct += int(max(range(2), key=lambda i: ll[i]) == it.gold)
            correct_norm += int(max(range(2), key=lambda i: norm[i]) == it.gold)
        assert res[r] == {"acc": correct / 2, "acc_norm": correct_norm / 2, "n": 2}
    enc = [encode_request(tok, c, x, 64) for c, x in item.requests]
    ll, _ = score_requests(model, enc, [3], CPU, batch_size=2)
    assert ll[1, 0].item() == pytest.approx(_loglik_by_hand(model, tok, *item.requests[1], 3), abs=1e-4)
    assert ll[1, 0].item() < ll[0, 0].item()  # the longer continuation has the lower sum


def test_lambada_accuracy_is_an_exact_greedy_match():
    model, tok = small_model(), CharTokenizer()
    context = "Once upon a time"
    ids = [tok.sep_id] + tok.encode(context)
    with torch.no_grad():
        for _ in range(3):  # the model's own greedy continuation, as characters of the stand-in tokenizer
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = "".join(chr((i - 1) % 61) for i in ids[-3:])
    assert tok.encode(greedy) == ids[-3:]
    items = [Item([(context, greedy)], kind="lambada"), Item([(context, "zzz")], kind="lambada")]
    # a continuation starting with " " is what the task adds; here the stand-in starts at the greedy character
    res = evaluate_task(model, tok, items, [3], CPU)
    wrong = tok.encode("zzz") != ids[-3:]
    assert wrong and res[3]["acc"] == 0.5
    ll = _loglik_by_hand(model, tok, context, greedy, 3) + _loglik_by_hand(model, tok, context, "zzz", 3)
    assert res[3]["ppl"] == pytest.approx(math.exp(-ll / 6), rel=1e-5)


def test_task_files_build_the_harness_prompts(tmp_path):
    rows = {
        "piqa": {
            "query": "Question: Make outdoor pillow.\n",
            "choices": ["Blow into tin can.", "Blow into bag."],
            "gold": 1,
        },
        "hellaswag": {
            "activity_label": "Roof",
            "ctx": "A man is on a roof. he",
            "endings": ["a", "b", "c", "d"],
            "label": "3",
        },
        "winogrande": {"context_options": ["X so Sarah", "X so Maria"], "continuation": "got it.", "gold": 1},
        "lambada": {"context": "He said", "continuation": "hello"},
    }
    for name, row in rows.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    piqa = load_task("piqa", tmp_path / "piqa.jsonl", limit=1)
    assert len(piqa) == 1 and piqa[0].requests[1] == ("Question: Make outdoor pillow.\nAnswer:", " Blow into bag.")
    assert piqa[0].gold == 1 and piqa[0].choice_chars == [19, 15]
    hs = load_task("hellaswag", tmp_path / "hellaswag.jsonl")[0]
    assert hs.requests[3] == ("Roof: A man is on a roof. he", " d") and hs.gold == 3
    wg = load_task("winogrande", tmp_path / "winogrande.jsonl")[0]
    assert [c for c, _ in wg.requests] == ["X so Sarah", "X so Maria"] and wg.requests[0][1] == " got it."
    lam = load_task("lambada", tmp_path / "lambada.jsonl")[0]
    assert lam.requests == [("He said", " hello")] and lam.kind == "lambada"


def test_long_requests_are_cut_from_the_left():
    tok = CharTokenizer()
    ids, n_cont = encode_request(tok, "a" * 100, " bc", max_len=10)
    assert len(ids) == 11 and n_cont == 3 and ids[-3:] == tok.encode(" bc")


# -- the command, end to end ---------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_inputs(grt_run, tmp_path_factory):
    from pretrain.infer.export import main as export_main

    root = tmp_path_factory.mktemp("evalcli")
    assert export_main(["--checkpoint", str(grt_run), "--out", str(root / "export")]) == 0
    eval_dir = root / "eval"
    eval_dir.mkdir()
    (eval_dir / "wikitext2_raw_test.txt").write_text(
        " = Valkyria Chronicles = \n\n The game began development in 2010 .\n" * 5
    )
    (eval_dir / "piqa.jsonl").write_text(
        "".join(
            json.dumps({"query": f"Question: q{i}\n", "choices": ["yes", "no way"], "gold": i % 2}) + "\n"
            for i in range(5)
        )
    )
    (eval_dir / "lambada_openai.jsonl").write_text(
        "".join(json.dumps({"context": f"It was a dark night {i}", "continuation": "again"}) + "\n" for i in range(5))
    )
    return root


def test_eval_command_writes_table_json_and_plot(eval_inputs, grt_run, manifest, capsys):
    root = eval_inputs
    argv = [
        str(root / "export"),
        "--tasks",
        "val,wikitext2,piqa,lambada",
        "--eval-dir",
        str(root / "eval"),
        "--data",
        str(manifest),
        "--max-batches",
        str(EVAL_BATCHES),
        "--limit",
        "4",
        "--depths",
        "0-5",
        "--allow-beyond-trained",
        "--json-out",
        str(root / "r.json"),
        "--plot",
        str(root / "r.png"),
    ]
    assert eval_main(argv) == 0
    table = capsys.readouterr().out
    assert "val loss" in table and "piqa acc_norm" in table and "beyond the trained maximum of 3" in table
    res = json.loads((root / "r.json").read_text())
    assert res["depths"] == [0, 1, 2, 3, 4, 5] and res["trained_loops"] == 3
    expected = summary(grt_run)["val_loss_by_depth"]
    for r, v in expected.items():
        assert res["val"][r]["loss"] == pytest.approx(v, abs=2e-5)
    assert res["tasks"]["piqa"]["3"]["n"] == 4 and res["tasks"]["lambada"]["0"]["n"] == 4
    wt = res["wikitext2"]["3"]
    assert wt["bpb"] == pytest.approx(wt["loss"] * wt["tokens"] / math.log(2) / wt["bytes"], rel=1e-9)
    assert (root / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_refuses_depths_beyond_training_in_one_line(eval_inputs, capsys):
    assert (
        eval_main(
            [
                str(eval_inputs / "export"),
                "--tasks",
                "wikitext2",
                "--eval-dir",
                str(eval_inputs / "eval"),
                "--depths",
                "0-8",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allow-beyond-trained" in err and "[4, 5, 6, 7, 8]" in err


@pytest.mark.slow
def test_distributed_eval_matches_one_process(eval_inputs, manifest, tmp_path):
    """Two gloo ranks under torchrun shard items and batches and all-reduce the sums."""
    root = eval_inputs
    common = [
        "--tasks",
        "val,piqa,wikitext2",
        "--eval-dir",
        str(root / "eval"),
        "--data",
        str(manifest),
        "--limit",
        "5",
        "--batch-size",
        "4",
    ]
    assert eval_main([str(root / "export"), *common, "--json-out", str(tmp_path / "one.json")]) == 0
    import socket

    with socket.socket() as sock:  # a free port: other jobs on the machine may hold a fixed one
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        port,
        "-m",
        "pretrain.cli",
        "eval",
        str(root / "export"),
        *common,
        "--json-out",
        str(tmp_path / "two.json"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert two["world_size"] == 2
    assert two["tasks"]["piqa"] == one["tasks"]["piqa"]
    for r in one["wikitext2"]:
        assert two["wikitext2"][r]["loss"] == pytest.approx(one["wikitext2"][r]["loss"], rel=1e-6)
    # the held-out split: each rank reads its own share; the token counts add up to whole batches
    assert two["val"]["0"]["tokens"] > 0
