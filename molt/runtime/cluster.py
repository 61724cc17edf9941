"""Where a run's processes run: joining or starting Ray, and the torch threads of workers and trainer ranks.

Design notes and decisions: docs/internals.md, section `molt/runtime/loop.py`.
"""

from __future__ import annotations

import os
import sys

from molt.config import MoltConfig


def torch_threads(cfg: MoltConfig) -> tuple[int, int]:
    """torch threads of (each worker, each trainer rank): share the cores when both run at once."""
    cores = os.cpu_count() or 1
    if cfg.train.max_staleness == 0:
        return cores, cores  # generation and training alternate
    return max(1, cores // 2), max(1, cores - cores // 2)


def init_ray(cfg: MoltConfig, attempts: int = 3) -> None:
    """Join `ray.address`, or start a new local instance (never another run's found in /tmp/ray: a shared
    machine). Ray gives its node a fixed 30 s to start; a loaded machine can miss that, so a local start is tried
    `attempts` times."""
    import ray

    if cfg.ray.address:
        return ray.init(address=cfg.ray.address, log_to_driver=False)
    for attempt in range(attempts):
        try:
            return ray.init(
                "local",
                num_cpus=cfg.ray.num_cpus or None,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
            )
        except Exception as e:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == attempts - 1:
                raise
            print(f"molt: Ray's node did not start in time ({e}); retrying", file=sys.stderr)
            ray.shutdown()
