"""Experience storage across nodes: a two-node cluster simulated on this machine (`ray.cluster_utils.Cluster`).

A worker on node A offloads segment payloads into node A's object store; a trainer rank on node B reloads them
by reference. The payload is fetched from node A (its only location before the fetch), and the controller, which
only passes records with references, never has the payload in its process.
"""

import numpy as np
import pytest
import ray

from molt.runtime.experience import outcome_from_trajectory
from molt.types import Segment, Trajectory


@ray.remote(num_cpus=0, resources={"node_a": 1})
class Producer:
    def make(self, n_tokens: int, image_mb: int):
        seg = Segment(
            list(range(n_tokens)),
            [1] * n_tokens,
            [-0.5] * n_tokens,
            [0] * n_tokens,
            images=np.ones(image_mb << 20, dtype=np.uint8),
        )
        out = outcome_from_trajectory(Trajectory("r0", "g0", [seg], reward=1.0))
        for e in out.experiences:  # in this node's object store
            e.payload_ref = ray.put(e.split())
        return out

    def node(self):
        return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0, resources={"node_b": 1})
class Rank:
    def reload(self, experiences):
        out = []
        for e in experiences:
            e.reload()
            out.append((len(e.token_ids), int(e.images.sum()), e.behavior_logprobs[0]))
        return out, ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")  # one cluster for both tests: starting one takes about 10 s here
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # the session's local instance; this test needs its own cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_ranks_reload_payloads_from_the_producing_node(two_nodes):
    producer, rank = Producer.remote(), Rank.remote()
    outcome = ray.get(producer.make.remote(64, 2))
    exp = outcome.experiences[0]
    assert exp.offloaded and exp.token_ids is None and exp.images is None  # the record is light
    node_a = ray.get(producer.node.remote())
    locations = ray.experimental.get_object_locations([exp.payload_ref])[exp.payload_ref]
    assert locations["node_ids"] == [node_a]  # the payload lives where it was produced
    (got, node_b) = ray.get(rank.reload.remote([exp]))
    assert node_b != node_a
    assert got == [(64, 2 << 20, -0.5)]


def test_a_run_joins_an_existing_cluster_by_address(two_nodes, tiny_llama_dir, tmp_path):
    """`--ray.address`: the run connects to the running two-node cluster (no local instance of its own) and
    trains on it."""
    import asyncio
    import json

    from test_train_e2e import _cfg

    from molt.runtime.loop import Run

    ray.shutdown()  # as in a fresh `molt train` process: only the address is known
    cfg = _cfg(tiny_llama_dir, tmp_path / "run", train__max_steps=1, rollout__num_workers=2)
    cfg.ray.address = two_nodes.address

    async def main():
        run = Run(cfg)
        try:
            await run.setup()
            nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            gcs = ray.get_runtime_context().gcs_address
            return await run.train(), nodes, gcs
        finally:
            await run.close()

    summary, nodes, gcs = asyncio.run(main())
    assert summary["steps"] == 1 and len(nodes) == 2 and gcs == two_nodes.address
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    json.loads((tmp_path / "run" / "summary.json").read_text())
