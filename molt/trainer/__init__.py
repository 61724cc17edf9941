"""The optimization side: FSDP2 actor (policy), critic and reference on Hugging Face models.

Public API (what the runtime calls; every call is collective over the trainer ranks):
    actor = Actor(cfg)   # a resolved molt.config.MoltConfig; or Actor.from_pretrained(path, **{"actor.adam.lr": ...})
    metrics = actor.train_step(experiences)                            # one optimizer window
    actor.compute_logprobs(experiences, reference=False)               # per-token log-probs
    for bucket in actor.iter_weights(bucket_bytes): ...                # [(hf_name, full tensor), ...]
    actor.save(dir); actor.load(dir); actor.export_hf(dir)
    critic = Critic(cfg)                                               # for gae (the critic section)
    values = critic.compute_values(exps); critic.train_step(exps, returns, old_values)

Imports molt.types, molt.algo and the records of molt.config (Actor.from_pretrained: also config_resolve and
config_validate), plus torch/transformers; torch loads when this package is imported.
"""

from molt.trainer.actor import Actor
from molt.trainer.critic import Critic
