"""The README's ``ray job submit`` command, submitted to a real Ray head on loopback.

The command is read from the README's "Deploying on a cluster" section, so the test breaks when
the README changes it; only the cluster's address and the values that size the run for a 2-step
CPU job are replaced (the rest of the command line, its config included, runs as written). The
head is started by this test with a temp dir of its own and stopped through the process group it
started, never through a ``ray stop`` that could reach another test's cluster.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN = "job-submit"

def readme_command() -> list[str]:
    """argv of the README's ``ray job submit`` block (a fenced bash block of that section)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Deploying on a cluster"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    block = next(b for b in blocks if b.lstrip().startswith("ray job submit"))
    return shlex.split(block.replace("\\\n", " "))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_argv(argv: list[str], dashboard: str, tmp: Path) -> list[str]:
    """The README's argv for the local head: its address, and a 2-step run on 2 CPU ranks."""
    assert argv[:3] == ["ray", "job", "submit"] and "--address" in argv and "--" in argv
    argv = list(argv)
    argv[argv.index("--address") + 1] = dashboard
    split = argv.index("--")
    small = {"trainer.run_name": RUN, "trainer.nnodes": "1", "trainer.n_gpus_per_node": "null",
             "actor.world_size": "2", "data.batch_size": "4", "actor.mini_batch_size": "8",
             "checkpoint.root": str(tmp / "ckpt"), "telemetry.port": "0",
             "telemetry.bind_address": "127.0.0.1"}
    extra = {"trainer.total_steps": "2", "trainer.device": "cpu", "trainer.output_dir": str(tmp / "runs"),
             "rollout.max_new_tokens": "8", "checkpoint.save_every": "1", "ray.cpus_per_worker": "0.5",
             "telemetry.enabled": "false"}
    entry = []
    for arg in argv[split + 1:]:
        key, eq, _ = arg.partition("=")
        entry.append(f"{key}={small.pop(key)}" if eq and key in small else arg)
    assert not small, f"the README's command no longer sets {sorted(small)}"
    entry += [f"{k}={v}" for k, v in extra.items()]
    return ["ray", *argv[1:split], "--", *entry]


@pytest.fixture
def ray_head():
    """A Ray head with its dashboard (the job server) on loopback; yields (dashboard URL, env)."""
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("the ray command is not installed beside this Python")
    try:
        import aiohttp_cors  # noqa: F401  ray[default]: the dashboard and the job server
    except ImportError:
        pytest.skip("ray[default] is not installed (./install.sh cluster)")
    temp = Path(tempfile.mkdtemp(prefix="rrl-js-", dir="/tmp"))   # short: Ray's socket paths
    port, dash, agent, client = free_port(), free_port(), free_port(), free_port()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("RAY_ADDRESS", None)
    # Ray turns token authentication on for a new head when a token exists in ~/.ray (left by any
    # earlier local cluster) while `ray job` stays off: this head and its clients run without it,
    # as deploy/slurm/train.sbatch starts its cluster.
    env["RAY_AUTH_MODE"] = "disabled"
    env.setdefault("RAY_DEDUP_LOGS", "0")
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
         # Ports of their own: Ray's defaults (52365, 10001) clash with any other local cluster.
         f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
         "--num-cpus=8", "--num-gpus=0", f"--temp-dir={temp}", "--object-store-memory=200000000",
         "--disable-usage-stats"],
        env=env, cwd=temp, start_new_session=True,
        stdout=open(temp / "head.out", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if head.poll() is not None:
                pytest.fail(f"ray start exited {head.returncode}:\n{(temp / 'head.out').read_text()[-3000:]}")
            probe = subprocess.run(["ray", "job", "list", "--address", url], env=env,
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the job server did not answer within 180 s:\n{probe.stderr[-3000:]}")
            time.sleep(2)
        yield url, env
    finally:
        # The head and everything it started (raylet, GCS, dashboard, workers) share its session.
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        _kill_session_leftovers(head.pid)
        shutil.rmtree(temp, ignore_errors=True)


def _kill_session_leftovers(sid: int) -> None:
    """Processes still in the head's session (workers that outlived it) are stopped by pid."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid:
                os.kill(int(entry.name), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def test_the_readme_command_is_a_bash_block_of_the_deploy_section():
    argv = readme_command()
    assert argv[:3] == ["ray", "job", "submit"]
    entry = argv[argv.index("--") + 1:]
    assert entry[:2] == ["resilient-rl", "train"]
    assert "--config" in entry


@pytest.mark.ray
@pytest.mark.slow  # 55-90 s on 2 shared cores: a Ray head with its dashboard, then a 2-step run
def test_the_readmes_ray_job_submit_trains_on_a_local_head(ray_head, tmp_path, monkeypatch):
    url, env = ray_head
    argv = local_argv(readme_command(), url, tmp_path)
    deadline = time.monotonic() + 180
    while True:
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        # The job server answers before the node's dashboard agent (which runs jobs) has registered;
        # a submission refused for that created no job.
        if "No available agent to submit job" not in done.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    found = re.search(r"(raysubmit_\w+)", done.stdout + done.stderr)
    assert found, done.stdout[-2000:]
    monkeypatch.setenv("RAY_AUTH_MODE", env["RAY_AUTH_MODE"])
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(url)
    assert client.get_job_status(found.group(1)) == JobStatus.SUCCEEDED, client.get_job_logs(found.group(1))[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / RUN / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "ckpt" / RUN / "step_00000002" / "MANIFEST.json").exists()
