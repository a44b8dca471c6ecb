"""The recipes of docs/parts.md for partitioned runs (`--part I/N`), run as written: GNU xargs always, a
Slurm job array under a single-node Slurm when one can be installed and started here, and the
Kubernetes Indexed Job's container command once per index. Each output must be byte-identical to a
single run's and read back by safetensors / PyTorch as the input's tensors."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_helpers import REPO, bitwise_equal
from conftest import ckpt_path, free_port, run_ckpt


def recipe(name: str) -> str:
    """The fenced block after `<!-- recipe: NAME -->` in docs/parts.md."""
    text = (REPO / "docs" / "parts.md").read_text()
    m = re.search(rf"<!-- recipe: {name} -->\n```[a-z]*\n(.*?)```", text, re.S)
    assert m, f"docs/parts.md has no recipe `{name}`"
    return m.group(1)


def tree(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def env_with_ckpt(**extra) -> dict:
    env = dict(os.environ, NO_COLOR="1", **extra)
    env["PATH"] = f"{ckpt_path().parent}{os.pathsep}{env['PATH']}"
    return env


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict]:
    """A FULL safetensors of about 3 MB (odd shapes, three dtypes) and a DCP over 3 ranks of it."""
    d = tmp_path_factory.mktemp("parts_in")
    g = torch.Generator().manual_seed(7)
    tensors = {
        "embed.weight": torch.randn(517, 301, generator=g).to(torch.bfloat16),
        "layers.0.attn.q": torch.randn(257, 259, generator=g),
        "layers.0.mlp.up": torch.randn(403, 131, generator=g).to(torch.float16),
        "layers.0.step": torch.tensor(3.0),
        "norm.weight": torch.randn(1013, generator=g),
    }
    full = d / "full.safetensors"
    save_file(tensors, str(full))
    dcp = d / "dcp"
    proc = run_ckpt("reshard", full, "-o", dcp, "--world-size", "3", "-q")
    assert proc.returncode == 0, proc.stderr
    return dcp, tensors


def single_run(tmp_path: Path, *args) -> Path:
    out = tmp_path / "single" / args[2].name
    out.parent.mkdir()
    proc = run_ckpt(*args[:2], "-o", out, *args[3:], "-q")
    assert proc.returncode == 0, proc.stderr
    return out


def test_xargs_recipe(tmp_path, source):
    dcp, tensors = source
    out = tmp_path / "parts" / "model.safetensors"
    out.parent.mkdir()
    proc = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + recipe("xargs")],
        env=env_with_ckpt(IN=str(dcp), OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sound" in proc.stdout, proc.stdout
    single = single_run(tmp_path, "consolidate", dcp, out)
    assert tree(out) == tree(single)
    got = load_file(str(out))
    assert sorted(got) == sorted(tensors)
    assert all(bitwise_equal(got[k], v) for k, v in tensors.items())


def test_kubernetes_indexed_job_command(tmp_path, source):
    """No Kubernetes here: the manifest is checked for an Indexed Job of N completions whose
    command says `--part $JOB_COMPLETION_INDEX/N`, and its container command runs once per index
    at the same time, with /ckpt mapped to a temporary directory."""
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load(recipe("kubernetes"))
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    n = spec["completions"]
    container = spec["template"]["spec"]["containers"][0]
    mount = container["volumeMounts"][0]["mountPath"]
    command = container["command"] + container["args"]
    assert f'--part "$JOB_COMPLETION_INDEX/{n}"' in command[-1], command
    root = tmp_path / "volume"
    root.mkdir()
    shutil.copytree(source[0], root / "step-1000")
    local = [c.replace(mount, str(root)) for c in command]
    procs = [
        subprocess.Popen(
            local,
            env=env_with_ckpt(JOB_COMPLETION_INDEX=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"index {i}: {out}{err}"
    m = re.search(r"reshard (\S+) -o (\S+) (.*?)\s+--part", local[-1], re.S)
    assert m, local[-1]
    output = Path(m.group(2))
    single = tmp_path / "single"
    proc = run_ckpt("reshard", m.group(1), "-o", single, *m.group(3).split(), "-q")
    assert proc.returncode == 0, proc.stderr
    assert tree(output) == tree(single)
    assert sorted(os.listdir(root)) == ["step-1000", output.name], "no staging area left"


# --- Slurm ---------------------------------------------------------------------------------------

SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "munged")


def slurm_installed() -> bool:
    return all(shutil.which(b) or Path(f"/usr/sbin/{b}").exists() for b in SLURM_BINARIES)


def try_install_slurm() -> str | None:
    """Install Debian's slurm-wlm when it is missing and this is root with apt-get; returns why
    not, or None when it is there. Bounded to a few minutes."""
    if slurm_installed():
        return None
    if os.environ.get("CKPT_TEST_NO_APT"):
        return "slurm-wlm is not installed and CKPT_TEST_NO_APT is set"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm is not installed, and installing it needs root and apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        for cmd in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm"],
        ):
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
            if p.returncode != 0:
                return f"`{' '.join(cmd)}` failed: {p.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as e:
        return f"`{' '.join(e.cmd)}` took longer than {e.timeout} s"
    return None if slurm_installed() else "slurm-wlm installed but its daemons are not on PATH"


def sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    """munged, slurmctld and slurmd of one node, with every path and port in `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = env_with_ckpt(SLURM_CONF=str(self.conf))
        self.pid_files = [root / "slurmd.pid", root / "slurmctld.pid", root / "munge" / "pid"]

    def start(self) -> str | None:
        r = self.root
        munge = r / "munge"
        for d in (munge, r / "state", r / "spool"):
            d.mkdir(parents=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = munge / "sock"
        p = subprocess.run(
            [sbin("munged"), "--force", f"--socket={sock}", f"--key-file={key}",
             f"--log-file={munge / 'log'}", f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}"],
            capture_output=True, text=True, timeout=30,
        )
        if p.returncode != 0:
            return f"munged did not start: {p.stderr.strip()[-300:]}"
        self.conf.write_text(
            f"""ClusterName=ckpttest
SlurmctldHost={self.host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName={self.host} CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        for daemon in (["slurmctld", "-i"], ["slurmd"]):
            p = subprocess.run([sbin(daemon[0]), *daemon[1:]], env=self.env, capture_output=True, text=True, timeout=30)
            if p.returncode != 0:
                return f"{daemon[0]} did not start: {(p.stdout + p.stderr).strip()[-300:]}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            p = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True, timeout=10)
            if p.returncode == 0 and p.stdout.strip() == "idle":
                return None
            time.sleep(0.5)
        logs = "".join(f.read_text()[-400:] for f in (r / "slurmctld.log", r / "slurmd.log") if f.exists())
        return f"the node did not become idle within 30 s: {logs}"

    def stop(self) -> None:
        for f in self.pid_files:
            try:
                pid = int(f.read_text().strip())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                pass


def test_slurm_array_recipe(tmp_path, source):
    why = try_install_slurm()
    if why:
        pytest.skip(f"no local Slurm: {why}")
    if os.geteuid() != 0:
        pytest.skip("no local Slurm: its daemons are started as root here")
    slurm = LocalSlurm(tmp_path / "slurm")
    try:
        why = slurm.start()
        if why:
            pytest.skip(f"no local Slurm: {why}")
        dcp, tensors = source
        out = tmp_path / "parts" / "model.bin"
        out.parent.mkdir()
        script = tmp_path / "consolidate.sbatch"
        # The README's script, converting to torch.save instead of safetensors.
        script.write_text(recipe("slurm").replace('-o "$OUT"', '-o "$OUT" --format torch'))
        n = 3
        p = subprocess.run(
            ["sbatch", "--wait", f"--array=0-{n - 1}", "--cpus-per-task=1",
             f"--output={tmp_path}/task-%a.log", f"--export=ALL,IN={dcp},OUT={out}", str(script)],
            env=slurm.env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )
        logs = "".join((tmp_path / f"task-{i}.log").read_text() for i in range(n) if (tmp_path / f"task-{i}.log").exists())
        assert p.returncode == 0, f"sbatch: {p.stdout}{p.stderr}\n{logs}"
        for i in range(n):
            assert f"part {i}/{n}: wrote" in logs, logs
        assert "all 3 parts done: committed" in logs, logs
        single = single_run(tmp_path, "consolidate", dcp, out, "--format", "torch")
        assert tree(out) == tree(single)
        got = torch.load(out, weights_only=True)
        assert all(bitwise_equal(got[k], v) for k, v in tensors.items())
    finally:
        slurm.stop()
