"""FSDP2 over two gloo ranks with images: rank 0 trains an image micro-batch, a text-only one and a ghost while
rank 1 trains four image micro-batches. Every micro-batch of a vision-language model runs its vision tower
once (one without images on a blank image whose features count 0 times), so the FSDP2 all-gathers and
reduce-scatters of the vision blocks match across ranks; the log-probs, the step and the critic (gae) then
agree with one process on the whole window."""

import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from vision_helpers import FSDP_SHARES, FSDP_WINDOW, fsdp_run, fsdp_worker

TIMEOUT_S = 240  # a mismatched collective hangs; the test fails instead


@pytest.fixture(scope="module")
def runs(tiny_vlm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-images")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.spawn(fsdp_worker, args=(2, port, str(tiny_vlm_dir), str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT_S  # a hang guard, not a speed check
    try:
        finished = False  # join returns False while one rank still runs (and raises if one failed)
        while not finished and time.monotonic() < deadline:
            finished = ctx.join(max(deadline - time.monotonic(), 0.1))
    finally:
        for p in ctx.processes:  # our own two children, by object
            if p.is_alive():
                p.kill()
    assert finished, f"the two ranks did not finish within {TIMEOUT_S} s (a collective mismatch hangs)"
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)], fsdp_run(tiny_vlm_dir)


def test_two_ranks_with_images_match_one_process(runs):
    ranks, one = runs
    assert FSDP_WINDOW.count("i") == 5
    for rank, share in zip(ranks, FSDP_SHARES):
        for i, lps in zip(share, rank["logprobs"]):
            assert lps == pytest.approx(one["logprobs"][i], abs=1e-5)
            assert any(lps)
        for i, vs in zip(share, rank["values"]):
            assert vs == pytest.approx(one["values"][i], abs=1e-5)
            assert any(vs)
    for key in ("policy_loss", "actor_grad_norm", "policy/entropy"):
        for rank in ranks:
            assert rank["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-5, rel=1e-5), key
    for key in ("critic_loss", "critic_grad_norm"):
        assert ranks[0]["critic"][key] == pytest.approx(one["critic"][key], abs=1e-5, rel=1e-5), key
    assert ranks[0]["value_head"] == pytest.approx(one["value_head"], rel=1e-5)
    diff = max(float((ranks[0]["params"][k] - one["params"][k]).abs().max()) for k in one["params"])
    print(f"max gradient difference (as the step's update): {diff:.2e}")
    assert diff <= 1e-5


def test_the_step_moved_the_vision_tower(runs, tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText

    initial = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).state_dict()
    _, one = runs
    moved = {
        k for k, v in one["params"].items() if "vision_tower" in k and (v - initial[k]).abs().max() > 1e-5
    }
    assert moved  # so the two-rank comparison covered a trained vision tower
