"""Slurm for real (`make test-slurm`, minutes, root): Debian's Slurm and munge are installed (apt) and a one-node
cluster started on this machine; a tiny-model run goes through `scripts/slurm.sbatch`, gets `scontrol requeue`d
mid-run, then preempted by a higher-priority job, and must finish by itself with an exactly-once ledger.

`scontrol requeue` sends SIGTERM to every process of the job at once, Ray's included; Ray's processes hold it
blocked, so `molt train` checkpoints the step in progress within KillWait (30 s, Slurm's default) and the requeued
job resumes it: the one-node run takes no periodic checkpoints. Preemption (with
SlurmctldParameters=preempt_send_user_signal) delivers the script's `--signal=B:TERM` to the batch shell only: `molt train` checkpoints the step in progress,
the job requeues itself, and the next start resumes that very step (docs/slurm.md).

The two-node test runs two slurmd nodes, each in a network namespace of its own on this machine, and checks that
the trainer ranks and rollout workers of a requeued run are placed on both."""

import contextlib
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
from fault_runs import AGENT, ROOT, ledger

from molt.testing.runs import check_exactly_once

STEPS = 10
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


def _sh(*cmd, env=None, check=True, cwd=None) -> str:
    return subprocess.run(
        cmd, env=env, check=check, capture_output=True, text=True, timeout=120, cwd=cwd
    ).stdout


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
        pytest.skip(
            "Slurm is not installed and cannot be (needs root and apt-get): apt-get install "
            + " ".join(PACKAGES)
        )
    done = subprocess.run(
        ["apt-get", "install", "-y", "-q", *PACKAGES],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )
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
    proc = subprocess.Popen(
        ["runuser", "-u", "munge", "--", "munged", "-F"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _wait(_munge_ok, 30, "munged")
    return proc


def _wait(predicate, timeout, what):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)


CONF = """ClusterName=molt
SlurmctldHost={ctld}
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
KillWait=30
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# the preempted job gets its --signal (B:TERM) first, then GraceTime to stop
SlurmctldParameters=preempt_send_user_signal
{nodes}
PartitionName=low Nodes=ALL Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=120
PartitionName=high Nodes=ALL PriorityTier=2 PreemptMode=OFF
"""


class Slurm:
    """A Slurm cluster of this machine's daemons, its files under `d`: this host as the one node, or `nodes`
    ({name: address}), each slurmd in the network namespace of its name (Namespaces)."""

    def __init__(self, d: Path, nodes: dict[str, str] | None = None):
        self.d, host = d, socket.gethostname()
        self.nodes = nodes or {host: ""}
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True)
        mem = psutil.virtual_memory().total // 2**20 * 9 // 10 // len(self.nodes)
        lines = [
            f"NodeName={n}"
            + (f" NodeAddr={a} NodeHostname={host}" if a else "")
            + f" CPUs={os.cpu_count()} RealMemory={mem} State=UNKNOWN"
            for n, a in self.nodes.items()
        ]
        conf = CONF.format(
            ctld=f"{host}({BRIDGE})" if nodes else host,
            ctld_port=_free_port(),
            slurmd_port=_free_port(),
            d=d,
            nodes="\n".join(lines),
        )
        (d / "slurm.conf").write_text(conf)
        self.env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        d = self.d
        # nsenter, not `ip netns exec`: that mounts a fresh /sys, where slurmd finds no cgroup file system
        cmds = [["slurmctld", "-D"]] + [
            ["nsenter", f"--net=/run/netns/{n}", "slurmd", "-D", "-N", n] if a else ["slurmd", "-D"]
            for n, a in self.nodes.items()
        ]
        logs = ["slurmctld.log"] + [f"slurmd-{n}.log" for n in self.nodes]
        self.daemons = [
            subprocess.Popen(c, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for c in cmds
        ]

        def idle():
            for p, log in zip(self.daemons, logs):
                assert p.poll() is None, (
                    f"{p.args} exited: {(d / log).read_text()[-2000:] if (d / log).exists() else ''}"
                )
            out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
            return {line.split()[0] for line in out.splitlines() if line.endswith(" idle")} >= set(self.nodes)

        _wait(idle, 60, "the nodes to be idle in sinfo")

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


BRIDGE, NODES = "10.77.0.1", {"molt-n1": "10.77.0.11", "molt-n2": "10.77.0.12"}


@contextlib.contextmanager
def namespaces():
    """A bridge with this host at BRIDGE and a network namespace per node of NODES on it (a veth pair each):
    each node its own address, all traffic between them inside what this creates; removed on the way out."""

    def remove():
        for n in NODES:
            subprocess.run(["ip", "netns", "del", n], check=False, capture_output=True)  # its veth end too
        subprocess.run(["ip", "link", "del", "br-molt"], check=False, capture_output=True)

    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter"):
        pytest.skip("two Slurm nodes on one host need root, ip (iproute2) and nsenter")
    remove()  # an interrupted run's
    try:
        _sh("ip", "link", "add", "br-molt", "type", "bridge")
        _sh("ip", "addr", "add", f"{BRIDGE}/24", "dev", "br-molt")
        _sh("ip", "link", "set", "br-molt", "up")
        for k, (n, addr) in enumerate(NODES.items()):
            _sh("ip", "netns", "add", n)
            _sh("ip", "link", "add", f"veth-molt{k}", "type", "veth", "peer", "name", "eth0", "netns", n)
            _sh("ip", "link", "set", f"veth-molt{k}", "master", "br-molt", "up")
            for cmd in (
                ["addr", "add", f"{addr}/24", "dev", "eth0"],
                ["link", "set", "eth0", "up"],
                ["link", "set", "lo", "up"],
                ["route", "add", "default", "via", BRIDGE],
            ):
                _sh("ip", "-n", n, *cmd)
        yield NODES
    finally:
        remove()


@contextlib.contextmanager
def cluster(d: Path, nodes: dict[str, str] | None = None):
    _install_or_skip()
    munged = _start_munge()  # its socket is a file: the namespaces share it
    slurm = Slurm(d, nodes)
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.close()
        if munged is not None:
            munged.terminate()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _steps(out: Path) -> int:
    return len(ledger(out)) // 2


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*/state.json"))


class Job:
    """A tiny-model run of `steps` steps submitted through scripts/slurm.sbatch from directory `d`."""

    def __init__(self, slurm: Slurm, d: Path, tiny: Path, steps: int, nodes: int, *args: str):
        env = {
            **slurm.env,
            "PY": str(Path(sys.executable).parent),
            "PYTHONPATH": str(ROOT),
            "RAY_PORT": str(_free_port() % 3000 + 6380),
        }  # below Ray's worker ports (10002-19999)
        args = (
            "--actor.model_name_or_path",
            str(tiny),
            "--train.agent_path",
            str(AGENT),
            "--data.prompt_dataset",
            str(ROOT / "recipes/math/data/single_train.jsonl"),
            "--rollout.batch_size",
            "2",
            "--rollout.n_samples_per_prompt",
            "2",
            "--rollout.max_new_tokens",
            "8",
            "--train.max_steps",
            str(steps),
            "--train.max_staleness",
            "0",
            "--ckpt.save_steps",
            "1",
            "--rollout.no_engine_process",
            *args,
        )
        self.slurm, self.steps, self.log, self.t0 = slurm, steps, d / "job.out", time.time()
        self.id = _sh(
            "sbatch",
            "--parsable",
            f"--nodes={nodes}",
            f"--output={self.log}",
            str(ROOT / "scripts/slurm.sbatch"),
            *args,
            env=env,
            cwd=d,
        ).strip()
        self.out = (
            d / f"runs/slurm-{self.id}"
        )  # the script's default run directory, under the submit directory
        print(f"\nslurm-test: submitted job {self.id} on {nodes} node(s)")

    def text(self) -> str:
        return self.log.read_text() if self.log.is_file() else ""

    def running(self, restart: int, steps: int, checkpointed: bool = True) -> None:
        """Waits until start `restart` of the job has trained (and checkpointed) step `steps`."""

        def reached():
            state = self.slurm.job(self.id)["JobState"]
            assert state not in ENDED, f"job {self.id} {state}; log:\n{self.text()[-3000:]}"
            return (
                f"restart {restart}," in self.text()
                and _steps(self.out) >= steps
                and (not checkpointed or _checkpoints(self.out)[-1:] >= [steps])
            )

        _wait(reached, 600, f"restart {restart} to train step {steps}; log:\n{self.text()[-3000:]}")

    def requeue(self) -> int:
        """`scontrol requeue`: SIGTERM to the whole job, Ray's processes too. The last checkpoint's step."""
        at, ckpt = _steps(self.out), _checkpoints(self.out)[-1]
        self.slurm.run("scontrol", "requeue", self.id)
        print(f"slurm-test: scontrol requeue {self.id} at step {at} (last checkpoint step_{ckpt})")
        return ckpt

    def completed(self, restarts: int) -> tuple[list[int], str]:
        """Waits for the job to complete by itself after `restarts` restarts, checks the exactly-once ledger and
        the optimizer's step count; the steps its starts resumed, and its log."""
        _wait(
            lambda: self.slurm.job(self.id)["JobState"] == "COMPLETED",
            900,
            f"job {self.id} to complete; log:\n{self.text()[-3000:]}",
        )
        log = self.text()
        resumed = [int(s) for s in re.findall(r"molt: resuming from .*step_(\d+)", log)]
        codes = re.findall(r"molt train exited with (\d+)", log)
        print(
            f"slurm-test: restarts {self.slurm.job(self.id)['Restarts']}, resumed from steps {resumed}, exit codes "
            f"of molt train: {codes}"
        )
        assert self.slurm.job(self.id)["Restarts"] == str(restarts), log[-3000:]
        assert log.count("molt-slurm: molt train exited with 0") == 1
        check_exactly_once(self.out, self.steps)
        assert json.loads((self.out / "summary.json").read_text())["steps"] == self.steps
        import torch.distributed.checkpoint as dcp

        state = {"train": {"step": -1}}
        dcp.load(state, checkpoint_id=str(self.out / "checkpoints" / f"step_{self.steps}" / "trainer"))
        assert (
            state["train"]["step"] == self.steps
        )  # one optimizer step a training step: none lost, none repeated
        print(
            f"slurm-test: ledger exactly-once over {self.steps} steps, optimizer steps {state['train']['step']}; "
            f"wall time {time.time() - self.t0:.0f} s"
        )
        return resumed, log


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_run_requeued_and_preempted_resumes_exactly_once(slurm, tiny_llama_dir, tmp_path):
    """No periodic checkpoints: those the run resumes come from the requeue's SIGTERM, which reaches every process
    of the job at once (Ray's survive it), and from the preemption's --signal."""
    job = Job(slurm, tmp_path, tiny_llama_dir, STEPS, 1, "--ckpt.save_steps", "1000")
    job.running(0, 2, checkpointed=False)
    at, sent = _steps(job.out), time.time()
    slurm.run("scontrol", "requeue", job.id)
    _wait(lambda: _checkpoints(job.out), 120, f"the requeue's checkpoint; log:\n{job.text()[-3000:]}")
    ckpt_before = _checkpoints(job.out)[-1]
    took = (job.out / "checkpoints" / f"step_{ckpt_before}" / "state.json").stat().st_mtime - sent
    print(f"slurm-test: scontrol requeue at step {at}: step_{ckpt_before} complete {took:.1f} s after it")
    job.running(1, ckpt_before + 2, checkpointed=False)
    preempt_at = _steps(job.out)
    high = slurm.run(
        "sbatch",
        "--parsable",
        "--partition=high",
        "--nodes=1",
        f"--output={tmp_path}/high.out",
        "--wrap",
        "sleep 1",
    ).strip()
    print(f"slurm-test: job {high} in the high partition preempts job {job.id} at step {preempt_at}")
    resumed, log = job.completed(restarts=2)
    stopped = [int(s) for s in re.findall(r"stopped by SIGTERM; step (\d+) is checkpointed", log)]
    print(f"slurm-test: the preempted run checkpointed step {stopped[-1:]}")
    # the requeue's checkpoint (of the step in progress, or the one before), then the preemption's: nothing redone
    assert resumed == stopped and resumed[0] == ckpt_before >= at and resumed[1] >= preempt_at


def _placement(nodes) -> dict[str, list[str]]:
    """{actor class: the namespaces its processes run in}, over the Ray actor processes in `nodes`' namespaces."""
    ns = {os.stat(f"/run/netns/{n}").st_ino: n for n in nodes}
    found: dict[str, list[str]] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(p.info["cmdline"] or [])
        kind = next((k for k in ("TrainerRank", "RolloutWorker") if f"ray::{k}" in title), None)
        try:
            where = ns.get(os.stat(f"/proc/{p.info['pid']}/ns/net").st_ino)
        except OSError:
            continue  # ended
        if kind and where:
            found.setdefault(kind, []).append(where)
    return {k: sorted(v) for k, v in found.items()}


@pytest.mark.slow
@pytest.mark.slurm
def test_two_node_sbatch_run_spans_both_nodes_and_resumes_exactly_once(tiny_llama_dir, tmp_path):
    """Two slurmd nodes, each in its own network namespace: Ray spans both, each node runs one trainer rank and
    one rollout worker, and a requeued run resumes with the exactly-once ledger."""
    with namespaces() as nodes, cluster(tmp_path / "slurm", nodes) as slurm:
        print(f"\nslurm-test: nodes {slurm.run('srun', '-N2', '-l', 'hostname', '-I').split()}")
        job = Job(
            slurm, tmp_path, tiny_llama_dir, 4, 2, "--train.num_ranks", "2", "--rollout.num_workers", "2"
        )
        job.running(0, 1)
        placement = _placement(nodes)
        print(f"slurm-test: placement {placement}")
        assert placement == {"TrainerRank": sorted(nodes), "RolloutWorker": sorted(nodes)}
        ckpt = job.requeue()
        resumed, log = job.completed(restarts=1)
        assert f"molt-slurm: 2 Ray nodes up at {nodes['molt-n1']}:" in log
        assert resumed[0] >= ckpt


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
