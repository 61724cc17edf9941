# my_estimators.py of docs/algo.md ("Add an advantage estimator"), verbatim: a user's estimator (--algo.plugins)
import torch

from molt.algo import AdvantageResult, register_estimator, rollout_stats, to_tokens


@register_estimator("grpo_median", "group")
def grpo_median(batch, params):
    """r - median reward of the group (counted once per rollout); 0 for a group of one."""
    s = rollout_stats(batch)  # s.reward, s.group: [R] tensors, one entry per rollout
    median = torch.stack([s.reward[s.group == g].median() for g in s.group.tolist()])
    adv = torch.where(s.group_size < 2, 0.0, s.reward - median)
    return AdvantageResult(advantages=to_tokens(adv, s, batch))
