"""A one-node Slurm cluster on loopback, for running the shipped sbatch recipe as a cluster would.

Debian's ``slurm-wlm`` and ``munge`` packages provide the daemons. :class:`SlurmCluster` writes a
minimal ``slurm.conf`` (one node, ``localhost``, with this machine's CPUs; no accounting; jobs may
be requeued), a fresh munge key, and every state, spool, log and socket path under a temporary
folder, so nothing of the system's own Slurm or munge setup is read or touched. It starts
``munged``, ``slurmctld`` and ``slurmd`` in the foreground as its own children and stops them by
their pids, after cancelling what jobs are left. Client commands (``sbatch``, ``scontrol``, ...)
are pointed at the cluster by ``SLURM_CONF`` in :attr:`SlurmCluster.env`.

The daemons run as root (``SlurmUser=root``): tests that use this need root and the binaries;
:func:`missing` says what is absent, for a skip reason.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Optional

from resilient_rl.runtime.master_env import free_port
from resilient_rl.testing.wait import wait_until

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue")

# Requeued jobs wait cred_expire seconds before they may start again (slurm.conf(5)); the default
# 120 s would make every requeue in a test a two-minute pause.
CONF = """\
ClusterName=rrltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={cred_expire}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
ReturnToService=2
JobRequeue=1
KillWait={kill_wait}
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=main Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> Optional[str]:
    """Why a local Slurm cluster cannot be started here, or None when it can."""
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None
              and not Path("/usr/sbin", name).exists()]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} not found): "
                "apt-get install slurm-wlm munge (as .ci/run does) to run this test")
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root (SlurmUser=root); run the test as root"
    return None


def _binary(name: str) -> str:
    # /usr/sbin is not on every user's PATH, but it is where Debian puts the daemons.
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """munged + slurmctld + slurmd for one node on loopback, rooted at ``root`` (a fresh folder).

    Use as a context manager: ``with SlurmCluster(tmp) as slurm: slurm.sbatch(...)``.
    """

    def __init__(self, root: Path, cred_expire_s: int = 5, kill_wait_s: int = 30,
                 start_timeout_s: float = 60.0) -> None:
        self.root = Path(root)
        self.cred_expire_s = cred_expire_s
        self.kill_wait_s = kill_wait_s
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Write the config and key, start the three daemons, wait until the node is idle."""
        for sub in ("state", "spool", "munge", "logs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a key or socket folder that others can read or write.
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        (self.root / "plugstack.conf").write_text("")
        self.conf.write_text(CONF.format(root=self.root, ctld_port=free_port("127.0.0.1"),
                                         slurmd_port=free_port("127.0.0.1"), cpus=os.cpu_count() or 1,
                                         cred_expire=self.cred_expire_s, kill_wait=self.kill_wait_s))
        m = self.root / "munge"
        self._spawn("munged", [_binary("munged"), "-F", "--force", f"--key-file={key}",
                               f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
                               f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"])
        wait_until(lambda: (m / "munge.socket").exists(), self.start_timeout_s, message=self._why("munged"))
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_binary("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)])
        wait_until(lambda: self.node_state().startswith("IDLE"), self.start_timeout_s, interval_s=0.5,
                   message=self._why("slurmd"))

    def stop(self) -> None:
        """Cancel what jobs are left (their processes belong to slurmd's steps), then stop the
        daemons by pid in reverse order of start: SIGTERM, and SIGKILL past 20 s."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
            try:
                wait_until(lambda: not self.jobs_alive(), 60, interval_s=0.5)
            except AssertionError:
                pass  # cleanup goes on: stopping slurmd below still ends what its steps left
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "logs" / f"{name}.out", "ab")
        with log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                stdin=subprocess.DEVNULL, start_new_session=True)

    def _why(self, name: str):
        """A message for a daemon that did not come up: its exit code and the end of its log."""
        def message() -> str:
            proc = self.procs.get(name)
            tails = []
            for path in (self.root / "logs" / f"{name}.out", self.root / f"{name}.log",
                         self.root / "munge" / f"{name}.log"):
                if path.exists():
                    tails.append(f"{path.name}: {path.read_text(errors='replace')[-2000:]}")
            return f"{name} ready (exit code {proc.poll() if proc else None}); " + "\n".join(tails)
        return message

    # -- clients ---------------------------------------------------------------------------

    def run(self, argv: list[str], timeout_s: float = 30.0, **kwargs) -> subprocess.CompletedProcess:
        """A client command against this cluster; raises with its stderr when it fails."""
        done = subprocess.run(argv, env=kwargs.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout_s, **kwargs)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, argv: list[str], env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None) -> int:
        """Submit ``sbatch --parsable <argv>`` and return the job id."""
        done = self.run(["sbatch", "--parsable", *argv], env={**self.env, **(env or {})}, cwd=cwd)
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of one job (JobState, Restarts, ExitCode, ...)."""
        out = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)]).stdout
        fields = {}
        for token in out.split():
            if "=" in token:
                key, value = token.split("=", 1)
                fields.setdefault(key, value)
        return fields

    def jobs_alive(self) -> bool:
        """Whether any job is still pending, running or completing (squeue's default states)."""
        out = subprocess.run(["squeue", "--noheader", "--format=%i"], env=self.env, capture_output=True,
                             text=True, timeout=30)
        return bool(out.stdout.strip())

    def node_state(self) -> str:
        """The node's state as sinfo reports it (IDLE, ALLOCATED, DOWN, ...), "" while unknown."""
        try:
            out = self.run(["scontrol", "show", "node", "--oneliner", "localhost"], timeout_s=10).stdout
        except (RuntimeError, subprocess.TimeoutExpired):
            return ""
        for token in out.split():
            if token.startswith("State="):
                return token.split("=", 1)[1]
        return ""
