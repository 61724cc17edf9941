"""Checkpoint rotation: ckpt.max_num keeps the newest ones, and never the best by ckpt.best_metric_key."""

import json

from molt.runtime.checkpoints import complete, rotate


def _ckpt(root, step, score=None):
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    metrics = {} if score is None else {"eval_test_pass1": score}
    (path / "state.json").write_text(json.dumps({"step": step, "metrics": metrics}))


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    for step, score in [(1, None), (2, 0.9), (3, None), (4, 0.5), (5, None)]:
        _ckpt(tmp_path, step, score)
    (tmp_path / "step_6").mkdir()  # incomplete (no state.json): never counted, never removed
    assert rotate(tmp_path, 0) == []  # 0 keeps all
    rotate(tmp_path, 3, "eval_test_pass1")
    assert [p.name for p in complete(tmp_path)] == ["step_2", "step_4", "step_5"]
    rotate(tmp_path, 1, "eval_test_pass1")  # the best (step 2) and the newest (step 5) stay
    assert [p.name for p in complete(tmp_path)] == ["step_2", "step_5"] and (tmp_path / "step_6").is_dir()
    rotate(tmp_path, 1)
    assert [p.name for p in complete(tmp_path)] == ["step_5"]
