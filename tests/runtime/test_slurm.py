"""Slurm for real (`make test-slurm`, minutes, root): Debian's Slurm and munge are installed (apt) and a one-node
cluster started on this machine; a tiny-model run goes through `scripts/slurm.sbatch`, gets `scontrol requeue`d
mid-run, then preempted by a higher-priority job, and must finish by itself with an exactly-once ledger.

`scontrol requeue` sends SIGTERM to every process of the job, Ray's included, so the requeued job resumes from
the last periodic checkpoint and redoes the steps after it. Preemption (# the preempted job gets its --signal (B:TERM) first, then GraceTime to stop
SlurmctldParameters=preempt_send_user_signal)
delivers the script's `--signal=B:TERM` to the batch shell only: `molt train` checkpoints the step in progress,
the job requeues itself, and the next start resumes that very step (docs/slurm.md)."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_faults import AGENT, ROOT, check_exactly_once, ledger

STEPS = 10
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


def _sh(*cmd, env=None, check=True, cwd=None) -> str:
    return subprocess.run(cmd, env=env, check=check, capture_output=True, text=True, timeout=120, cwd=cwd).stdout


def _munge_ok() -> bool:
    return subprocess.run("munge -n | unmunge", shell=True, check=False, capture_output=True).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _install_or_skip() -> None:
    if all(shutil.which(p) for p in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and cannot be (needs root and apt-get): apt-get install " + " ".join(PACKAGES))
    done = subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], check=False, capture_output=True,
                          text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if done.returncode:
        pytest.skip(f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr[-500:]}")


def _start_munge() -> subprocess.Popen | None:
    """munged, as the `munge` user (it refuses root), unless one answers already."""
    if _munge_ok():
        return None
    for d in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
        os.makedirs(d, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    if not os.path.exists("/etc/munge/munge.key"):
        _sh("runuser", "-u", "munge", "--", "mungekey", "-c")
    proc = subprocess.Popen(["runuser", "-u", "munge", "--", "munged", "-F"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait(_munge_ok, 30, "munged")
    return proc


def _wait(predicate, timeout, what):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)


CONF = """ClusterName=molt
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
# a requeued job may start again cred_expire + 1 s later (default 120 s)
AuthInfo=cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
ReturnToService=2
KillWait=10
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# the preempted job gets its --signal (B:TERM) first, then GraceTime to stop
SlurmctldParameters=preempt_send_user_signal
NodeName={host} CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=low Nodes=ALL Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=120
PartitionName=high Nodes=ALL PriorityTier=2 PreemptMode=OFF
"""


class Slurm:
    """A one-node Slurm cluster of this machine's daemons, its files under `d`."""

    def __init__(self, d: Path):
        self.d = d
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True)
        conf = CONF.format(host=socket.gethostname(), ctld_port=_free_port(), slurmd_port=_free_port(), d=d,
                           cpus=os.cpu_count(), mem=psutil.virtual_memory().total // 2**20 * 9 // 10)
        (d / "slurm.conf").write_text(conf)
        self.env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        d = self.d
        self.daemons = [subprocess.Popen([name, "-D"], env=self.env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL) for name in ("slurmctld", "slurmd")]
        def idle():
            for p, log in zip(self.daemons, ("slurmctld.log", f"slurmd-{socket.gethostname()}.log")):
                assert p.poll() is None, f"{p.args[0]} exited: {(d / log).read_text()[-2000:] if (d / log).exists() else ''}"
            return "idle" in self.run("sinfo", "-h", "-o", "%T", check=False)
        _wait(idle, 60, "the node to be idle in sinfo")

    def run(self, *cmd, check=True) -> str:
        return _sh(*cmd, env=self.env, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", job_id)))

    def close(self) -> None:
        if self.daemons:  # the jobs' processes first: they outlive slurmd
            self.run("scancel", "--full", "--user", "root", check=False)
            _wait(lambda: not self.run("squeue", "-h", check=False).strip(), 120, "the jobs to end")
        for p in self.daemons:
            p.terminate()
            p.wait(30)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    _install_or_skip()
    munged = _start_munge()
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
        if munged is not None:
            munged.terminate()


def _steps(out: Path) -> int:
    return len(ledger(out)) // 2


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*/state.json"))


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_run_requeued_and_preempted_resumes_exactly_once(slurm, tiny_llama_dir, tmp_path):
    t0 = time.time()
    env = {**slurm.env, "PY": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT),
           "RAY_PORT": str(_free_port() % 3000 + 6380)}  # below Ray's worker ports (10002-19999)
    args = ["--actor.model_name_or_path", str(tiny_llama_dir), "--train.agent_path", str(AGENT),
            "--data.prompt_dataset", str(ROOT / "recipes/math/data/single_train.jsonl"), "--rollout.batch_size", "2",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "8", "--train.max_steps", str(STEPS),
            "--train.max_staleness", "0", "--ckpt.save_steps", "1", "--rollout.no_engine_process"]
    log = tmp_path / "job.out"
    job_id = _sh("sbatch", "--parsable", "--nodes=1", f"--output={log}", str(ROOT / "scripts/slurm.sbatch"), *args,
                 env=env, cwd=tmp_path).strip()
    out = tmp_path / f"runs/slurm-{job_id}"  # the script's default run directory, under the submit directory
    text = lambda: log.read_text() if log.is_file() else ""
    print(f"\nslurm-test: submitted job {job_id}")

    def running(restart: int, steps: int):
        def reached():
            state = slurm.job(job_id)["JobState"]
            assert state not in ENDED, f"job {job_id} {state}; log:\n{text()[-3000:]}"
            return f"restart {restart}," in text() and _steps(out) >= steps and _checkpoints(out)[-1:] >= [steps]
        _wait(reached, 600, f"restart {restart} to train step {steps}; log:\n{text()[-3000:]}")

    running(0, 2)
    requeued_at, ckpt_before = _steps(out), _checkpoints(out)[-1]
    slurm.run("scontrol", "requeue", job_id)  # SIGTERM to the whole job, Ray's processes too
    print(f"slurm-test: scontrol requeue {job_id} at step {requeued_at} (last checkpoint step_{ckpt_before})")
    running(1, ckpt_before + 2)
    preempt_at = _steps(out)
    high = slurm.run("sbatch", "--parsable", "--partition=high", "--nodes=1", f"--output={tmp_path}/high.out",
                     "--wrap", "sleep 1").strip()
    print(f"slurm-test: job {high} in the high partition preempts job {job_id} at step {preempt_at}")
    _wait(lambda: slurm.job(job_id)["JobState"] == "COMPLETED", 900, f"job {job_id} to complete; log:\n{text()[-3000:]}")
    wall = time.time() - t0

    log_text = text()
    resumed = [int(s) for s in re.findall(r"molt: resuming from .*step_(\d+)", log_text)]
    stopped = [int(s) for s in re.findall(r"stopped by SIGTERM; step (\d+) is checkpointed", log_text)]
    codes = re.findall(r"molt train exited with (\d+)", log_text)
    print(f"slurm-test: restarts {slurm.job(job_id)['Restarts']}, resumed from steps {resumed}, the preempted run "
          f"checkpointed step {stopped[-1:]}, exit codes of molt train: {codes}")
    assert slurm.job(job_id)["Restarts"] == "2", log_text[-3000:]
    assert resumed[0] >= ckpt_before  # the checkpoint the requeue found (the step in progress may have finished)
    assert len(resumed) == 2 and resumed[1] == stopped[-1] >= preempt_at  # preempted: nothing redone
    assert log_text.count("molt-slurm: molt train exited with 0") == 1
    check_exactly_once(out, STEPS)
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS
    import torch.distributed.checkpoint as dcp

    state = {"train": {"step": -1}}
    dcp.load(state, checkpoint_id=str(out / "checkpoints" / f"step_{STEPS}" / "trainer"))
    assert state["train"]["step"] == STEPS  # one optimizer step a training step: none lost, none repeated
    print(f"slurm-test: ledger exactly-once over {STEPS} steps, optimizer steps {state['train']['step']}; "
          f"wall time {wall:.0f} s")


@pytest.mark.slow
def test_trainer_ranks_spread_over_the_ray_nodes():
    """Two Ray nodes on this machine: the two trainer ranks land one on each, every time. Ray alone places actors
    that reserve nothing (num_cpus=0) anywhere, its SPREAD strategy too (7 of 10 tries put a pair on one node)."""
    import ray
    from ray._private.state import actors
    from ray.cluster_utils import Cluster

    from molt.runtime.trainer_group import TrainerGroup

    ray.shutdown()  # the shared local instance, if a test started it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="error")
        cluster.wait_for_nodes()
        for _ in range(4):
            ranks = TrainerGroup(2).ranks
            ray.get([r.master_address.remote() for r in ranks])  # created
            nodes = [actors(r._actor_id.hex())["Address"]["NodeID"] for r in ranks]
            assert len(set(nodes)) == 2, nodes
            for r in ranks:
                ray.kill(r)
    finally:
        ray.shutdown()
        cluster.shutdown()
