"""deploy/: every recipe parses, and the trainer command it embeds is one the real CLI parser and
config loader accept, on a cluster shape that matches its resources and checkpoint root."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from resilient_rl.checkpoint.shared_root import require_shared_root
from resilient_rl.cli import build_parser
from resilient_rl.config.schema import load_config

ROOT = Path(__file__).resolve().parents[1]
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"
README = ROOT / "README.md"


def overrides_of(argv: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in argv if "=" in item and not item.startswith("-"))


def validated(argv: list[str]):
    """The config a ``resilient-rl train ...`` command line would run with, through the real
    parser and loader; returns (config, overrides by key)."""
    assert argv[:2] == ["resilient-rl", "train"], argv[:2]
    args = build_parser().parse_args(argv[1:])
    assert args.func.__name__ == "cmd_train"
    return load_config(args.config, args.overrides), overrides_of(args.overrides)


def check_shape(cfg, overrides: dict[str, str], nodes: int, gpus_per_node: int) -> None:
    """The trainer's cluster shape is the recipe's: nnodes x n_gpus_per_node GPUs, all for the actor."""
    assert int(overrides["trainer.nnodes"]) == nodes
    assert int(overrides["trainer.n_gpus_per_node"]) == gpus_per_node
    assert cfg.actor.world_size == nodes * gpus_per_node


# -- KubeRay -------------------------------------------------------------------------------

def kuberay_documents() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(RAYJOB.read_text()) if d]
    assert len({d["kind"] for d in docs}) == len(docs)
    return {d["kind"]: d for d in docs}


def test_the_rayjob_runs_the_trainer_on_gpu_workers_with_a_valid_command_line():
    docs = kuberay_documents()
    job = docs["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    cluster = job["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"]
    cfg, overrides = validated(shlex.split(job["spec"]["entrypoint"]))
    check_shape(cfg, overrides, workers["replicas"], gpus)
    # head + workers: a checkpoint root every node reaches (the trainer checks it at start)
    require_shared_root(cfg.checkpoint, nodes=1 + workers["replicas"])
    assert cfg.checkpoint.root.startswith("s3://")
    # the run folder is on the head's persistent volume
    head = cluster["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    claim = volumes[mounts[cfg.trainer.output_dir]]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]


def test_the_rayjob_image_installs_what_its_own_config_needs():
    """The image recipe installs the extras the RayJob's config uses: s3fs for an s3:// checkpoint
    root (``fsspec`` alone cannot open it), Ray's job server for the submitter, and Ray of the
    version pyproject.toml asks for."""
    import re
    import tomllib

    dockerfile = (RAYJOB.parent / "Dockerfile").read_text()
    cfg, _ = validated(shlex.split(kuberay_documents()["RayJob"]["spec"]["entrypoint"]))
    (install,) = re.findall(r"^RUN \./install\.sh (\S+)$", dockerfile, re.M)
    extras = set(install.split(","))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extras <= set(project["optional-dependencies"])
    needed = {"s3": "s3fs", "gs": "gcsfs"}
    scheme = cfg.checkpoint.root.split("://", 1)[0]
    if scheme in needed:
        assert any(needed[scheme] in dep for extra in extras for dep in project["optional-dependencies"][extra]), \
            (scheme, extras)
    assert "cluster" in extras
    (image,) = re.findall(r"^FROM rayproject/ray:(\S+)", dockerfile, re.M)
    from packaging.version import Version

    ray_floor = next(d for d in project["dependencies"] if d.startswith("ray"))
    assert Version(image.split("-")[0]) >= Version(ray_floor.split(">=")[1]), (image, ray_floor)
    for job_image in {c["image"] for c in _containers(kuberay_documents()["RayJob"])}:
        assert job_image == "ghcr.io/example/resilient-rl:latest"


def _containers(job: dict) -> list[dict]:
    cluster = job["spec"]["rayClusterSpec"]
    groups = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_the_rayjob_sizes_dev_shm_for_snapshots_and_exposes_metrics():
    docs = kuberay_documents()
    job = docs["RayJob"]
    cfg, _ = validated(shlex.split(job["spec"]["entrypoint"]))
    assert cfg.recovery.snapshot_every >= 1 and cfg.recovery.snapshot_node_dir == "/dev/shm"
    cluster = job["spec"]["rayClusterSpec"]
    templates = {"head": (cluster["headGroupSpec"]["template"], cfg.telemetry.port),
                 "worker": (cluster["workerGroupSpecs"][0]["template"], cfg.telemetry.worker_port_base)}
    assert cfg.telemetry.bind_address == "0.0.0.0"  # reachable from Prometheus, not loopback only
    monitor = docs["PodMonitor"]["spec"]
    for where, (template, port) in templates.items():
        spec, meta = template["spec"], template["metadata"]
        (container,) = spec["containers"]
        shm = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"}
        (volume,) = [v for v in spec["volumes"] if v["name"] in shm]
        assert volume["emptyDir"]["medium"] == "Memory", where
        assert re.fullmatch(r"\d+Gi", volume["emptyDir"]["sizeLimit"]), where  # not Docker's 64 MB default
        assert port > 0
        assert meta["annotations"]["prometheus.io/scrape"] == "true"
        assert meta["annotations"]["prometheus.io/port"] == str(port), where
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        (endpoint,) = monitor["podMetricsEndpoints"]
        assert named[endpoint["port"]] == port, where
        assert monitor["selector"]["matchLabels"].items() <= meta["labels"].items(), where
        # The dashboards filter every panel on run=~"$run": the scraped series need that label.
        assert meta["labels"]["resilient-rl/run"] == cfg.trainer.run_name, where
        assert {"sourceLabels": ["__meta_kubernetes_pod_label_resilient_rl_run"], "targetLabel": "run"} in \
            endpoint["relabelings"], where


def test_the_rayjob_head_passes_an_eviction_to_the_trainer_and_waits_for_it(tmp_path):
    """The head's preStop hook signals the controller that controller.json names and waits for it
    to exit, within a grace period longer than the trainer's own."""
    import json
    import os
    import signal
    import sys
    import time

    job = kuberay_documents()["RayJob"]
    cfg, _ = validated(shlex.split(job["spec"]["entrypoint"]))
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert head["terminationGracePeriodSeconds"] > cfg.trainer.preempt_grace_s
    shell, flag, hook = head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    record = f"{cfg.trainer.output_dir}/{cfg.trainer.run_name}/controller.json"
    assert f"record={record}\n" in hook
    # The hook, run against a stand-in controller that takes 0.5 s to stop on SIGTERM.
    controller = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                   "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit(143)))\n"
                                   "print('ready', flush=True)\nwhile True: time.sleep(0.05)\n"],
                                  stdout=subprocess.PIPE, text=True)
    try:
        assert controller.stdout.readline() == "ready\n"
        import threading

        reaper = threading.Thread(target=controller.wait, daemon=True)  # its parent reaps it, as in the pod
        reaper.start()
        (tmp_path / "controller.json").write_text(json.dumps({"pid": controller.pid, "state": "running"}))
        done = subprocess.run([shell, flag, hook.replace(record, str(tmp_path / "controller.json"))], timeout=30)
        reaper.join(timeout=5)
        assert done.returncode == 0 and controller.returncode == 143  # it waited until the controller exited
    finally:
        if controller.poll() is None:
            os.kill(controller.pid, signal.SIGKILL)
            controller.wait()
    (tmp_path / "controller.json").write_text(json.dumps({"pid": os.getpid(), "state": "finished"}))
    t0 = time.monotonic()
    subprocess.run([shell, flag, hook.replace(record, str(tmp_path / "controller.json"))], timeout=30, check=True)
    assert time.monotonic() - t0 < 25  # an ended run: nothing to signal, nothing to wait for


# -- Slurm ---------------------------------------------------------------------------------

SLURM_ENV = {"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "8", "HEAD_IP": "10.1.0.7", "RAY_PORT": "6379",
             "SHARED": "/lustre/alice/resilient-rl", "PATH": "/usr/bin:/bin"}


def sbatch_directives() -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), flags=re.M))


def slurm_train_argv(env: dict[str, str], args: tuple[str, ...] = ()) -> list[str]:
    """The script's trainer command, expanded by bash itself in ``env``, for ``sbatch train.sbatch *args``."""
    text = SBATCH.read_text()
    block = re.search(r"^# >>> trainer command.*?\n(.*?)^# <<< trainer command", text, flags=re.M | re.S)
    assert block, "the trainer command block is marked in the script"
    script = block.group(1) + '\nprintf "%s\\0" "${TRAIN[@]}"\n'
    out = subprocess.run(["bash", "-euc", script, "train.sbatch", *args], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


def test_the_sbatch_script_is_valid_bash_and_starts_a_head_and_a_worker_per_node():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    assert re.search(r"ray start --head\b", text) and re.search(r'ray start --address="\$HEAD_IP:\$RAY_PORT"', text)
    assert 'for node in "${NODES[@]:1}"' in text  # every node but the head's gets a worker
    # `ray stop` would stop every Ray process on the node, other jobs' too: the script ends its own steps
    assert not re.search(r"^[^#]*\bray stop\b", text, flags=re.M)


def test_the_sbatch_scripts_arguments_override_its_trainer_command():
    """``sbatch train.sbatch key=value ...``: the arguments come last, so they win (a CPU-only
    allocation, as chaos/test_slurm_preemption.py submits, sets no GPUs per node)."""
    env = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_GPUS_PER_NODE"}
    argv = slurm_train_argv({**env, "SLURM_JOB_NUM_NODES": "1"},
                            ("trainer.n_gpus_per_node=null", "actor.world_size=2", "trainer.total_steps=7"))
    assert argv[-3:] == ["trainer.n_gpus_per_node=null", "actor.world_size=2", "trainer.total_steps=7"]
    cfg, _ = validated(argv)
    assert cfg.trainer.n_gpus_per_node is None and cfg.actor.world_size == 2 and cfg.trainer.total_steps == 7


@pytest.mark.parametrize("nodes", [None, 4])
def test_the_sbatch_trainer_command_matches_the_allocation_and_validates(nodes):
    directives = sbatch_directives()
    n = nodes or int(directives["nodes"])  # `sbatch --nodes=4` overrides the directive
    gpus = int(directives["gpus-per-node"])
    argv = slurm_train_argv({**SLURM_ENV, "SLURM_JOB_NUM_NODES": str(n), "SLURM_GPUS_PER_NODE": str(gpus)})
    cfg, overrides = validated(argv)
    check_shape(cfg, overrides, n, gpus)
    assert cfg.ray.address == "10.1.0.7:6379"
    require_shared_root(cfg.checkpoint, nodes=n)  # a shared file system, declared as such
    assert cfg.checkpoint.root.startswith(SLURM_ENV["SHARED"]) and cfg.checkpoint.shared_filesystem


def test_the_sbatch_script_passes_slurms_signals_to_the_trainer_and_requeues_a_preempted_job(tmp_path):
    """Slurm signals the batch shell (--signal=B:USR1@..., then SIGTERM); the script must pass
    both on to the trainer, keep waiting for it, exit with its 143 and requeue the job."""
    import os
    import signal
    import sys
    import time

    directives = sbatch_directives()
    assert directives["signal"].startswith("B:USR1@") and "requeue" in re.findall(r"^#SBATCH --([\w-]+)$",
                                                                                   SBATCH.read_text(), flags=re.M)
    assert re.search(r'if \[ "\$status" -eq 143 \]; then[^\n]*\n\s*scontrol requeue "\$SLURM_JOB_ID"',
                     SBATCH.read_text())
    block = re.search(r"^# >>> run the trainer.*?\n(.*?)^# <<< run the trainer", SBATCH.read_text(), flags=re.M | re.S)
    assert block, "the block that runs the trainer is marked in the script"
    seen = tmp_path / "signals"
    stand_in = (f"import signal, sys, time, pathlib\np = pathlib.Path({str(seen)!r})\n"
                "def note(s, _f):\n    p.write_text(p.read_text() + signal.Signals(s).name + '\\n')\n"
                "    if s == signal.SIGTERM: sys.exit(143)\n"
                "signal.signal(signal.SIGUSR1, note)\nsignal.signal(signal.SIGTERM, note)\n"
                "p.write_text('')\nwhile True: time.sleep(0.05)\n")
    script = f"TRAIN=({shlex.quote(sys.executable)} -c {shlex.quote(stand_in)})\n{block.group(1)}exit \"$status\"\n"
    shell = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script])
    try:
        for sig, expect in ((signal.SIGUSR1, "SIGUSR1\n"), (signal.SIGTERM, "SIGUSR1\nSIGTERM\n")):
            deadline = time.monotonic() + 30
            while not seen.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(shell.pid, sig)
            while seen.read_text() != expect and time.monotonic() < deadline:
                time.sleep(0.02)
            assert seen.read_text() == expect
        assert shell.wait(timeout=30) == 143
    finally:
        if shell.poll() is None:
            shell.kill()


# -- ray job submit (README) ---------------------------------------------------------------

def test_the_readme_ray_job_submit_command_validates():
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ray job submit"))
    command = []
    for line in lines[start:]:
        command.append(line.rstrip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            break
    argv = shlex.split(" ".join(command))
    assert "--address" in argv and "--" in argv
    cfg, overrides = validated(argv[argv.index("--") + 1:])
    check_shape(cfg, overrides, int(overrides["trainer.nnodes"]), int(overrides["trainer.n_gpus_per_node"]))
    require_shared_root(cfg.checkpoint, nodes=int(overrides["trainer.nnodes"]) + 1)
    # ray job submit sets RAY_ADDRESS for the entrypoint: the trainer joins that cluster
    assert cfg.ray.address is None


def test_the_readme_ray_job_submit_names_the_extra_that_brings_rays_job_server():
    """``ray job submit`` and the head's job server need ``ray[default]`` (aiohttp_cors, the
    dashboard); plain ``ray`` fails with ``No module named 'aiohttp_cors'``."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("ray[default]") for req in extras["cluster"])
    assert any(req.startswith("ray[default]") for req in extras["dev"])
    text = README.read_text()
    section = text[text.index("## Deploying on a cluster"):text.index("ray job submit --address")]
    assert "./install.sh cluster" in section and ".[cluster]" in section
    install = (ROOT / "install.sh").read_text()
    assert 'target=".[${extra}]"' in install and 'pip install -e "$target"' in install
    assert "./install.sh cluster" in install


def test_the_sbatch_script_removes_the_ray_address_file_that_names_its_own_dead_cluster(tmp_path):
    """`ray start` leaves <Ray's temp dir>/ray_current_cluster behind when ended by a signal; the
    script's last step removes it wherever it names the job's cluster, and only there."""
    body = re.search(r"bash -c '(.*?)' ray-address-cleanup", SBATCH.read_text(), flags=re.S)
    assert body, "the script removes the address files after stopping Ray"

    def cleanup(start_args: str, env: dict[str, str]) -> None:
        subprocess.run(["bash", "-c", body.group(1), "ray-address-cleanup", "6379", start_args],
                       env={"PATH": "/usr/bin:/bin", **env}, check=True)

    def address_file(root: Path, text: str) -> Path:
        (root / "ray").mkdir(parents=True, exist_ok=True)
        path = root / "ray" / "ray_current_cluster"
        path.write_text(text)
        return path

    ours = address_file(tmp_path / "a", "192.0.2.2:6379")  # the head writes the address it resolved
    cleanup("--include-dashboard=false", {"TMPDIR": str(tmp_path / "a")})
    assert not ours.exists()
    other = address_file(tmp_path / "b", "10.1.0.7:6380")  # another job's cluster on a shared node
    cleanup("", {"RAY_TMPDIR": str(tmp_path / "b"), "TMPDIR": str(tmp_path / "a")})
    assert other.read_text() == "10.1.0.7:6380"
    for args in (f"--temp-dir={tmp_path / 'c' / 'ray'}", f"--num-gpus=0 --temp-dir {tmp_path / 'c' / 'ray'}"):
        given = address_file(tmp_path / "c", "10.1.0.7:6379")
        cleanup(args, {"RAY_TMPDIR": str(tmp_path / "b")})
        assert not given.exists() and other.exists()


def test_the_deployed_ray_processes_start_with_capped_malloc_arenas():
    """As a local cluster's do (resilient_rl.env.limit_malloc_arenas): the nodes' `ray start` of a
    Slurm job, and every container of the RayJob's image."""
    from resilient_rl import env

    assert f"export MALLOC_ARENA_MAX=${{MALLOC_ARENA_MAX:-{env.MALLOC_ARENAS}}}" in SBATCH.read_text()
    dockerfile = (ROOT / "deploy" / "kuberay" / "Dockerfile").read_text()
    assert re.search(rf"^ENV MALLOC_ARENA_MAX={env.MALLOC_ARENAS}$", dockerfile, re.MULTILINE)
