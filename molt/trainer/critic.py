"""The critic for `gae`: a Hugging Face backbone (`AutoModel`, no LM head) with a scalar value head, sharded
and optimized like the actor (the run's fsdp and train sections), with the critic section's model, optimizer and
value clip.

Layout: `values[t]` is the value of the state in which token t was sampled, i.e. the head applied to the
hidden state at t-1 (the same shift as the log-probs), 0 off action tokens (`molt.algo` "values" field).
Decision: the value head starts at zero (weight and bias), so the first advantages are plain discounted
returns rather than the noise of a random projection.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from molt.algo import value_loss, window_normalize
from molt.config import MoltConfig
from molt.trainer import parallel
from molt.trainer.base import ShardedModelTrainer
from molt.trainer.logprobs import hidden_states, scatter_actions
from molt.trainer.optim import build_optimizer
from molt.types import Experience


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.get_text_config().hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, mb) -> Tensor:
        """mb: a `molt.trainer.batching.MicroBatch` -> [R, L] fp32 values, zero off the action tokens."""
        hidden = hidden_states(self.backbone, self.backbone, mb)
        # the state before token t is summarized at position t - 1 (of the same sequence, packed or not)
        v = self.value_head(hidden.flatten(0, 1).index_select(0, mb.act_index - 1)).squeeze(-1).float()
        return scatter_actions(v, mb.act_index, mb.input_ids.shape)


class Critic(ShardedModelTrainer):
    """`Critic(cfg)`: a resolved `molt.config.MoltConfig` (`--critic.model_name_or_path`, `--critic.adam.*`, ...)."""

    def __init__(self, cfg: MoltConfig):
        from transformers import AutoModel

        c = cfg.critic
        super().__init__(cfg, c)
        # the value model runs whole rows: finding shared prefixes would be wasted work
        self.share_prefix = False
        self.value_clip = c.value_clip or None
        backbone = self.load_lm(c.model_name_or_path or cfg.actor.model_name_or_path, AutoModel)
        blocks = parallel.decoder_layers(backbone) if c.optim == "muon" else ()  # before FSDP2 renames them
        self.model = self.wrap(ValueModel(backbone), backbone, trainable=True)
        self.optimizers, self.schedulers = build_optimizer(
            self.model.parameters(), c, tp_size=cfg.fsdp.tp_size, blocks=blocks
        )

    @torch.no_grad()
    def compute_values(self, experiences: list[Experience]) -> list:
        """Per-token values of each experience (float32 arrays, 0.0 off action tokens). Collective."""
        return self.per_token_pass(self.model, experiences, self.model)

    def train_step(self, experiences: list[Experience], returns: list, old_values: list) -> dict[str, float]:
        """One optimizer step of the clipped value loss, window-normalized like the policy loss. Collective."""
        t0 = time.perf_counter()

        def loss_of(mb, global_count: torch.Tensor, dp: int) -> tuple[torch.Tensor, dict]:
            tok, metrics = value_loss(
                self.model(mb), mb.extra["old_values"], mb.extra["returns"], mb.action_mask, self.value_clip
            )
            return window_normalize(tok, mb.action_mask, global_count, dp_size=dp)[0], metrics

        out, step = self.train_window(
            experiences,
            loss_of,
            "critic_loss",
            need_advantages=False,
            extra={"returns": returns, "old_values": old_values},
        )
        out.update(
            {
                "critic_grad_norm": step["grad_norm"],
                "critic_lr": step["lr"],
                "train/skipped_steps": step["train/skipped_steps"],
                "timing/critic_train": time.perf_counter() - t0,
            }
        )
        return out
