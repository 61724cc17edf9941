"""Molt: agentic reinforcement learning of Hugging Face language models (docs/design.md).

`import molt` imports nothing else. The public API is what these packages export:
- `molt.agents`: the agent contract that agent files import (`ChatAgent`, `Env`, `Result`, `Runner`, ...);
- `molt.algo`: the estimators, losses and KL estimators and their registries, for plugin files (`algo.plugins`);
- `molt.trainer`: `Actor` and `Critic`.
Everything else is imported from the module that defines it, e.g. `molt.cli.load_config` (argv to a validated
`molt.config.MoltConfig`), `molt.config_resolve.override`/`resolve`, `molt.config_validate.validate`,
`molt.runtime.loop.run_training`, `molt.runtime.sft.run_sft`, the records of `molt.types`. Nothing in the
package re-exports a name for compatibility.
"""
