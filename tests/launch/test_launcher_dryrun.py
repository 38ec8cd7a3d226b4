"""`grt launch --dry-run` for 4 nodes x 8 GPUs, checked against what each real tool accepts.

The deepspeed command is parsed by DeepSpeed's own runner parser and its hostfile read by
DeepSpeed's own hostfile reader; the mpirun command is mapped by the real `mpirun
--do-not-launch --display-map`; the sbatch script is checked with `bash -n` (and with
`sbatch --test-only` against a real cluster in test_launcher_slurm.py).
"""

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from launcher.cli import build_plan, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = [
    "--preset",
    "grt-small",
    "--data",
    "data/shards/manifest.json",
    "--out",
    "runs/grt-small",
    "--set",
    "train.lr=3e-4",
]
RUN_DIR = os.path.abspath("runs/grt-small")
CONFIG = os.path.join(RUN_DIR, "launch", "config.json")
ENV = {
    "NCCL_IB_HCA": "mlx5_0,mlx5_1",
    "NCCL_SOCKET_IFNAME": "ib0",
    "GRT_TEST_FLAG": "1",
    "PATH": os.environ.get("PATH", ""),
    "UNRELATED_SECRET": "x",
    "WANDB_API_KEY": "k",
    "HF_TOKEN": "t",
}


def plan_for(launcher, *extra, environ=None, train=TRAIN):
    argv = ["--launcher", launcher, "--nodes", "4", "--gpus-per-node", "8", *extra, "--dry-run", "--", *train]
    plan, args = build_plan(argv, environ=dict(ENV if environ is None else environ))
    return plan


def split_render(text):
    """Dry-run text -> ({path: content}, command argv, env prefix)."""
    files, cur, body, command = {}, None, [], None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#### file: "):
            cur, body = line[len("#### file: ") :], []
        elif line == "#### end of file":
            files[cur] = "\n".join(body) + "\n"
            cur = None
        elif line == "#### command":
            command = lines[i + 1]
            break
        elif cur is not None:
            body.append(line)
    argv = shlex.split(command)
    env = {}
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        k, v = argv.pop(0).split("=", 1)
        env[k] = v
    return files, argv, env


# --------------------------------------------------------------------------- deepspeed


def test_deepspeed_4x8_against_deepspeed_runner(tmp_path):
    from deepspeed.launcher import runner as ds_runner

    plan = plan_for("deepspeed", "--hosts", "node[1-4]", "--master-port", "29555")
    files, argv, env = split_render(plan.render())
    assert argv[0] in ("deepspeed", sys.executable)
    args = ds_runner.parse_args(argv[argv.index("--hostfile") :])
    assert (args.num_nodes, args.num_gpus) == (4, 8)
    assert (args.master_addr, args.master_port, args.launcher) == ("node1", 29555, "pdsh")
    assert args.module and args.no_local_rank and args.user_script == "pretrain.cli"
    # the run config is resolved here once; every rank gets the same file
    assert args.user_args == ["train", "--config-json", CONFIG]
    config = json.loads(files[CONFIG])
    assert config["model"]["name"] == "grt-small" and config["train"]["lr"] == 3e-4
    assert config["out"] == RUN_DIR and config["data"] == os.path.abspath("data/shards/manifest.json")
    # the hostfile, read by DeepSpeed itself
    hostfile = files[args.hostfile]
    assert hostfile == "".join(f"node{i} slots=8\n" for i in range(1, 5))
    (tmp_path / "hostfile").write_text(hostfile)
    pool = ds_runner.fetch_hostfile(str(tmp_path / "hostfile"))
    active = ds_runner.parse_inclusion_exclusion(pool, "", "")
    active = ds_runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    assert {h: len(s) for h, s in active.items()} == {f"node{i}": 8 for i in range(1, 5)}
    # .deepspeed_env: KEY=VALUE lines that the runner exports on every node
    env_file = env["DS_ENV_FILE"]
    assert os.path.basename(env_file) == ".deepspeed_env"
    lines = dict(line.split("=", 1) for line in files[env_file].splitlines())
    assert lines["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" and lines["NCCL_SOCKET_IFNAME"] == "ib0"
    assert lines["GRT_TEST_FLAG"] == "1" and "UNRELATED_SECRET" not in lines
    assert "WANDB_API_KEY" not in lines and "HF_TOKEN" not in lines  # secrets stay out of files
    assert "PYTHONPATH" in lines
    # the per-node command DeepSpeed's pdsh backend builds from all this
    from deepspeed.launcher.multinode_runner import PDSHRunner

    runner = PDSHRunner(args, ds_runner.encode_world_info(active))
    for key, val in lines.items():
        runner.add_export(key, val)
    cmd, _kill, _env = runner.get_cmd({}, active)
    assert cmd[0] == "pdsh" and cmd[cmd.index("-w") + 1] == "node1,node2,node3,node4"
    line = " ".join(cmd)
    assert "export NCCL_IB_HCA=mlx5_0,mlx5_1;" in line and "deepspeed.launcher.launch" in line
    assert "--node_rank=%n" in line and "--master_addr=node1" in line and "--master_port=29555" in line
    assert "--no_local_rank" in line and line.endswith(f"pretrain.cli train --config-json {CONFIG}")


def test_deepspeed_honours_env_hostfile_and_master_addr(tmp_path):
    hf = tmp_path / "myhosts"
    hf.write_text("# cluster\nworker-0 slots=8\nworker-1 slots=8\nworker-2 slots=8\nworker-3 slots=8\n")
    environ = dict(ENV, DLTS_HOSTFILE=str(hf), MASTER_ADDR="10.0.0.7", MASTER_PORT="6001")
    plan, _ = build_plan(["--launcher", "deepspeed", "--launcher-args=-S", "--dry-run", "--", *TRAIN], environ=environ)
    files, argv, env = split_render(plan.render())
    from deepspeed.launcher import runner as ds_runner

    args = ds_runner.parse_args(argv[1:] if argv[0] == "deepspeed" else argv[3:])
    assert args.hostfile == str(hf) and str(hf) not in files  # used as is, not rewritten
    assert (args.num_nodes, args.num_gpus) == (4, 8)
    assert (args.master_addr, args.master_port) == ("10.0.0.7", 6001)
    assert args.launcher == "pdsh" and args.launcher_args == "-S"


def test_deepspeed_openmpi_backend_gets_a_hostfile_of_the_chosen_ranks(tmp_path):
    """The runner's MPI backends start one rank per hostfile slot and refuse --num_nodes and
    --num_gpus (DeepSpeed's own OpenMPIRunner checks the command here): 3 of 4 hosts at 2 of
    their 8 slots become a hostfile of exactly those 6 ranks."""
    hf = tmp_path / "myhosts"
    hf.write_text("".join(f"worker-{i} slots=8\n" for i in range(4)))
    plan, _ = build_plan(
        [
            "--launcher",
            "deepspeed",
            "--ds-launcher",
            "openmpi",
            "--hostfile",
            str(hf),
            "--nodes",
            "3",
            "--procs-per-node",
            "2",
            "--launcher-args",
            "--mca btl_tcp_if_include ib0",
            "--dry-run",
            "--",
            *TRAIN,
        ],
        environ=ENV,
    )
    files, argv, _ = split_render(plan.render())
    from deepspeed.launcher import runner as ds_runner
    from deepspeed.launcher.multinode_runner import OpenMPIRunner

    args = ds_runner.parse_args(argv[1:] if argv[0] == "deepspeed" else argv[3:])
    assert files[args.hostfile] == "worker-0 slots=2\nworker-1 slots=2\nworker-2 slots=2\n"
    assert (args.num_nodes, args.num_gpus, args.launcher) == (-1, -1, "openmpi")
    assert args.launcher_args.endswith("--mca btl_tcp_if_include ib0")
    assert ("--allow-run-as-root" in args.launcher_args) == (os.geteuid() == 0)  # as --launcher mpi adds it
    pool = {f"worker-{i}": 2 for i in range(3)}
    cmd = OpenMPIRunner(args, "", pool).get_cmd({}, pool)  # its constructor validates the arguments
    assert cmd[cmd.index("-n") + 1] == "6"
    with pytest.raises(ValueError, match="--include/--exclude: the deepspeed runner's openmpi backend"):
        build_plan(
            [
                "--launcher",
                "deepspeed",
                "--ds-launcher",
                "openmpi",
                "--hostfile",
                str(hf),
                "--exclude",
                "worker-3",
                "--dry-run",
                "--",
                *TRAIN,
            ],
            environ=ENV,
        )


def test_deepspeed_no_ssh_node_rank():
    plan = plan_for("deepspeed", "--hosts", "a,b,c,d", "--no-ssh", "--node-rank", "2")
    _, argv, _ = split_render(plan.render())
    assert "--no_ssh" in argv and "--node_rank=2" in argv and "--launcher=pdsh" not in argv


def test_deepspeed_errors():
    with pytest.raises(SystemExit, match=r"^4 nodes need --hostfile or --hosts \(or a Slurm allocation\)$"):
        plan_for("deepspeed")  # 4 nodes, no hosts anywhere
    with pytest.raises(ValueError, match=r"^--no-ssh needs --node-rank \(this node's index in the hostfile\)$"):
        plan_for("deepspeed", "--hosts", "a,b,c,d", "--no-ssh")  # no node rank


# --------------------------------------------------------------------------- mpi


def test_mpi_4x8_command():
    plan = plan_for("mpi", "--hosts", "node[1-4]")
    files, argv, env = split_render(plan.render())
    assert argv[0] == "mpirun" and argv[argv.index("-np") + 1] == "32"
    hostfile = argv[argv.index("--hostfile") + 1]
    assert files[hostfile] == "".join(f"node{i} slots=8\n" for i in range(1, 5))
    assert argv[argv.index("--map-by") + 1] == "ppr:8:node"
    exported = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert {
        "NCCL_IB_HCA",
        "NCCL_SOCKET_IFNAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PYTHONPATH",
        "PATH",
        "LD_LIBRARY_PATH",
        "GRT_TEST_FLAG",
    } <= exported
    assert "UNRELATED_SECRET" not in exported
    assert {"WANDB_API_KEY", "HF_TOKEN"} <= exported  # by name: the value is in no file
    assert env["MASTER_ADDR"] == "node1"
    tail = argv[argv.index("-m") :]
    assert tail == ["-m", "pretrain.cli", "train", "--config-json", CONFIG]
    assert CONFIG in files


def test_mpi_4x8_mapped_by_real_mpirun(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (Debian package openmpi-bin)")
    plan = plan_for("mpi", "--hosts", "node[1-4]", "--run-dir", str(tmp_path))
    files, argv, env = split_render(plan.render())
    for path, content in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)
    # map the job without launching anything: ranks 0-7 on node1, ..., 24-31 on node4
    i = argv.index("-m") - 1  # the python executable
    cmd = argv[:1] + ["--do-not-launch", "--display-map"] + argv[1:i] + ["true"]
    run_env = dict(os.environ, **env, **{k: v for k, v in ENV.items() if k != "PATH"})
    r = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=60)
    out = r.stdout + r.stderr
    per_node = {}
    node = None
    for line in out.splitlines():
        m = re.search(r"Data for node: (\S+)\s+Num slots: (\d+)", line)
        if m:
            node = m.group(1)
            assert m.group(2) == "8", line
            per_node[node] = []
        m = re.search(r"Process rank: (\d+)", line)
        if m and node:
            per_node[node].append(int(m.group(1)))
    assert per_node == {f"node{n}": list(range(8 * (n - 1), 8 * n)) for n in range(1, 5)}, out


# --------------------------------------------------------------------------- slurm


def test_slurm_4x8_script(tmp_path):
    plan = plan_for(
        "slurm",
        "--time",
        "24:00:00",
        "--partition",
        "gpu",
        "--account",
        "proj",
        "--requeue",
        "--signal",
        "USR1@300",
        "--container-image",
        "nvcr.io#me/grt:latest",
        "--run-dir",
        str(tmp_path / "run"),
    )
    files, argv, env = split_render(plan.render())
    script_path = argv[-1]
    assert argv[:2] == ["sbatch", "--parsable"] and script_path.endswith("slurm.sbatch")
    script = files[script_path]
    header = [line[len("#SBATCH ") :] for line in script.splitlines() if line.startswith("#SBATCH ")]
    for opt in (
        "--nodes=4",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--time=24:00:00",
        "--partition=gpu",
        "--account=proj",
        "--signal=B:USR1@300",
        "--requeue",
        "--open-mode=append",
    ):
        assert opt in header, (opt, header)
    assert any(h.startswith("--output=") and h.endswith("slurm-%j.out") for h in header)
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in script
    assert "export NCCL_IB_HCA=mlx5_0,mlx5_1" in script and "UNRELATED_SECRET" not in script
    assert "WANDB_API_KEY" not in script  # the job inherits it from the submitting shell
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    srun_argv = shlex.split(srun.rstrip(" &"))
    assert "--container-image=nvcr.io#me/grt:latest" in srun_argv
    assert any(a.startswith("--container-mounts=") for a in srun_argv)
    # --resume: a requeued or resubmitted job continues from its newest checkpoint
    config = str(tmp_path / "run" / "launch" / "config.json")
    assert srun_argv[-7:] == ["python", "-m", "pretrain.cli", "train", "--config-json", config, "--resume"]
    assert config in files and f"{tmp_path / 'run'}:{tmp_path / 'run'}" in srun
    assert "trap 'forward USR1' USR1" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    path = tmp_path / "s.sbatch"
    path.write_text(script)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_slurm_apptainer_and_no_signal(tmp_path):
    plan = plan_for("slurm", "--apptainer", "grt.sif", "--signal", "", "--run-dir", str(tmp_path))
    files, argv, _ = split_render(plan.render())
    script = files[argv[-1]]
    assert "--signal" not in script and "trap" not in script and "--requeue" not in script
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    i = srun.index("apptainer")
    assert srun[i : i + 3] == ["apptainer", "exec", "--nv"] and "grt.sif" in srun
    (tmp_path / "s.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "s.sh")]).returncode == 0


def test_slurm_cpu_job_has_no_gpus(tmp_path):
    plan, _ = build_plan(
        [
            "--launcher",
            "slurm",
            "--cpu",
            "--procs-per-node",
            "2",
            "--run-dir",
            str(tmp_path),
            "--dry-run",
            "--data",
            "m.json",
        ],
        environ={},
    )
    files, argv, _ = split_render(plan.render())
    script = files[argv[-1]]
    assert "--ntasks-per-node=2" in script and "--gpus-per-node" not in script and "--nv" not in script
    assert "export CUDA_VISIBLE_DEVICES=''" in script  # --cpu: no rank picks up a GPU


# --------------------------------------------------------------------------- local and CLI


def test_local_commands():
    plan, _ = build_plan(["--no-resolve", "--dry-run", "--", "--preset", "tiny-grt"], environ={})
    assert plan.command == [sys.executable, "-m", "pretrain.cli", "train", "--preset", "tiny-grt"]
    plan, _ = build_plan(["--procs-per-node", "2", "--dry-run", "--no-resolve", "--preset", "tiny-grt"], environ={})
    assert plan.command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert plan.command[-4:] == ["pretrain.cli", "train", "--preset", "tiny-grt"]  # unknown args pass
    # --help reaches `grt train` unresolved
    plan, _ = build_plan(["--dry-run", "--", "--help"], environ={})
    assert plan.command[-2:] == ["train", "--help"]


def test_config_errors_are_reported_before_launching(capsys):
    assert main(["--launcher", "slurm", "--dry-run", "--", "--preset", "no-such-preset", "--data", "x"]) == 2
    assert "no-such-preset" in capsys.readouterr().err
    assert main(["--launcher", "deepspeed", "--dry-run", "--", "--preset", "tiny-grt"]) == 2  # no --data
    assert "--data" in capsys.readouterr().err


def test_grt_launch_dry_run_through_grt_cli(tmp_path, capsys):
    assert (
        main(
            [
                "--launcher",
                "slurm",
                "--nodes",
                "2",
                "--gpus-per-node",
                "4",
                "--run-dir",
                str(tmp_path),
                "--dry-run",
                "--",
                "--data",
                "m.json",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in out and out.strip().splitlines()[-1].startswith("sbatch")
    assert not os.listdir(tmp_path)  # a dry run writes nothing
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.cli",
            "launch",
            "--launcher",
            "mpi",
            "--hosts",
            "a,b",
            "--gpus-per-node",
            "8",
            "--dry-run",
            "--data",
            "m.json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "-np 16" in r.stdout.splitlines()[-1]


def test_slurm_hosts_become_a_nodelist(tmp_path):
    plan = plan_for("slurm", "--hosts", "gpu[01-04]", "--run-dir", str(tmp_path))
    files, argv, _ = split_render(plan.render())
    assert "#SBATCH --nodelist=gpu01,gpu02,gpu03,gpu04" in files[argv[-1]]


def test_train_flags_pass_without_separator(tmp_path):
    """Unknown flags go to `grt train`, even those that look like abbreviations of ours."""
    out = str(tmp_path / "run")
    plan, _ = build_plan(
        ["--launcher", "slurm", "--cpu", "--dry-run", "--data", "m.json", "--out", out, "--steps", "7"], environ={}
    )
    files, argv, _ = split_render(plan.render())
    config = json.loads(files[os.path.join(out, "launch", "config.json")])
    assert config["out"] == out and config["train"]["steps"] == 7
    assert f"--output={out}/slurm-%j.out" in files[argv[-1]]


# --------------------------------------------------------------------------- cluster habits


def write_manifest(root):
    """A manifest whose tokenizer and shards live in three different directories."""
    from data_pipeline.manifest import manifest_dict

    for d in ("meta", "tok", "shards-a", "shards-b"):
        (root / d).mkdir(parents=True)
    (root / "tok" / "tok.model").write_bytes(b"")
    for d in ("shards-a", "shards-b"):
        (root / d / "s0.bin").write_bytes(b"")
    split = lambda d: [{"name": str(root / d / "s0.bin"), "sequences": 1, "tokens": 64}]  # noqa: E731
    manifest = manifest_dict(
        seq_len=64,
        vocab_size=512,
        sep_id=0,
        sep_piece="",
        ext="u16",
        tokenizer_name=str(root / "tok" / "tok.model"),
        tokenizer_sha256=hashlib.sha256(b"").hexdigest(),  # the empty tok.model's: a manifest's tokenizer is hashed
        splits={"train": split("shards-a"), "val": split("shards-b")},
        sources=[],
        stats={},
        options={},
    )
    path = root / "meta" / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


def srun_line(plan):
    files, argv, _ = split_render(plan.render())
    script = files[argv[-1]]
    return script, shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")).rstrip(" &"))


def test_slurm_container_mounts_the_data_and_uses_the_image_code(tmp_path, monkeypatch):
    manifest = write_manifest(tmp_path / "data")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # launched from outside the checkout
    run = tmp_path / "runs" / "r"
    train = ["--preset", "tiny-grt", "--data", str(manifest), "--out", str(run)]
    plan = plan_for("slurm", "--container-image", "grt.sqsh", train=train)
    script, srun = srun_line(plan)
    mounts = next(a for a in srun if a.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    d = tmp_path / "data"
    expected = [str(p) for p in (d / "meta", d / "shards-a", d / "shards-b", d / "tok", run, tmp_path / "work")]
    assert sorted(m.split(":")[0] for m in mounts) == sorted(expected + [os.path.join(ROOT, "ds_configs")])
    assert all(m.split(":")[0] == m.split(":")[1] for m in mounts)  # each at its own path
    assert f"--container-workdir={tmp_path / 'work'}" in srun
    # the image's code: no checkout mounted or on PYTHONPATH, the working directory not first on sys.path
    assert "unset PYTHONPATH" in script and "export PYTHONSAFEPATH=1" in script
    # --host-code: this checkout, mounted and first on PYTHONPATH
    script, srun = srun_line(plan_for("slurm", "--apptainer", "grt.sif", "--host-code", train=train))
    binds = srun[srun.index("--bind") + 1].split(",")
    assert ROOT in binds and str(d / "tok") in binds and srun[srun.index("--pwd") + 1] == str(tmp_path / "work")
    assert f"export PYTHONPATH={ROOT}" in script and "PYTHONSAFEPATH" not in script


def test_slurm_cpus_per_task_rank_logs_and_dated_log_lines(tmp_path):
    plan = plan_for(
        "slurm", "--cpus-per-task", "12", "--exclusive", "--mem", "0", "--rank-logs", "--run-dir", str(tmp_path)
    )
    script, srun = srun_line(plan)
    assert "#SBATCH --cpus-per-task=12" in script and "--cpus-per-task=12" in srun
    assert "#SBATCH --exclusive" in script and "#SBATCH --mem=0" in script
    assert f"--output={tmp_path}/logs/rank%t.log" in srun and "--open-mode=append" in srun
    assert f"mkdir -p {tmp_path}/logs" in script
    assert "date '+%Y-%m-%d %H:%M:%S'" in script and 'echo "grt:' not in script
    (tmp_path / "s.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "s.sh")]).returncode == 0


def test_slurm_without_gpus_is_refused_in_one_line(capsys):
    assert main(["--launcher", "slurm", "--nodes", "4", "--dry-run", "--", *TRAIN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpus-per-node" in err and "--cpu" in err
    assert main(["--launcher", "slurm", "--cpu", "--gpus-per-node", "8", "--dry-run", "--", *TRAIN]) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_deepspeed_runner_options_pass_through(capsys):
    from deepspeed.launcher import runner as ds_runner

    plan = plan_for(
        "deepspeed",
        "--hosts",
        "node[1-4]",
        "--include",
        "node1:0,1@node2",
        "--exclude",
        "node3",
        "--ssh-port",
        "2222",
        "--no-ssh-check",
        "--rank-logs",
    )
    _, argv, _ = split_render(plan.render())
    args = ds_runner.parse_args(argv[argv.index("--hostfile") :])
    assert (args.include, args.exclude, args.ssh_port, args.no_ssh_check) == ("node1:0,1@node2", "node3", 2222, True)
    assert args.enable_each_rank_log == os.path.join(RUN_DIR, "logs")
    capsys.readouterr()
    with pytest.raises(SystemExit):  # DeepSpeed's slurm backend cannot start a module
        plan_for("deepspeed", "--hosts", "node[1-4]", "--ds-launcher", "slurm")
    assert "grt launch: error: argument --ds-launcher: invalid choice: 'slurm'" in capsys.readouterr().err


def test_rank_logs_on_local_and_mpi():
    local, _ = build_plan(
        ["--procs-per-node", "2", "--rank-logs", "--dry-run", "--no-resolve", "--", *TRAIN], environ={}
    )
    assert local.command[local.command.index("--log-dir") + 1] == os.path.join(RUN_DIR, "logs")
    mpi = plan_for("mpi", "--hosts", "node[1-4]", "--rank-logs")
    assert mpi.command[mpi.command.index("--output-filename") + 1] == os.path.join(RUN_DIR, "logs")


def test_deepspeed_config_is_merged_and_checked_before_submission(tmp_path, capsys):
    ds = tmp_path / "megatron.json"
    ds.write_text(
        json.dumps(
            {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1}}
        )
    )
    # the merged config the 32 ranks will use is written next to the run config
    plan = plan_for("slurm", train=TRAIN + ["--micro-batch-size", "4", "--ds-config", str(ds)])
    files, _, _ = split_render(plan.render())
    merged = json.loads(files[os.path.join(RUN_DIR, "launch", "ds_config.json")])
    assert merged["train_batch_size"] == 4 * 32 and merged["bf16"]["enabled"] is True
    # a disagreement stops the launch before sbatch, in one line
    assert (
        main(
            [
                "--launcher",
                "slurm",
                "--nodes",
                "4",
                "--gpus-per-node",
                "8",
                "--dry-run",
                "--",
                *TRAIN,
                "--ds-config",
                str(ds),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train_micro_batch_size_per_gpu=4" in err and "train.micro_batch_size = 8" in err
