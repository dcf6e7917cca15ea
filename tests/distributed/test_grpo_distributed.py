"""GRPO with 2 processes under the DDP, ZeRO-2 and ZeRO-3 templates: one launch per template runs every variant the
tests below compare (tests/distributed/grpo_job.py's RUNS, one trainer after the other in the same processes)."""

import os

import pytest
import torch

from tests import tiers
from tests.conftest import REPO, launch, rank_reports
from trainers.sampling.advantages import group_advantages

JOB = os.path.join(REPO, "tests", "distributed", "grpo_job.py")


def rows_of(slots: list[int]) -> list[str]:
    return [["abc", "hello", "xyz", "12"][i] for i in slots]  # grpo_job.py's prompts


# template -> the runs its one launch makes (grpo_job.py's RUNS), for every test below
LAUNCHES = {
    "multi_gpu": ["plain", "one_forward", "checkpointing", "checkpointing_one_forward", "skip", "every", "entropy"],
    "zero2": ["plain", "one_forward", "skip", "every"],
    "zero3": ["plain", "rollout_func", "sync_ref", "budget", "rows"],
}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """``runs(template, run)``: the reports of one run (one per rank), from the template's launch, made once for the
    module when a test first needs it. In the fast tier, where only the smoke test runs here, its run alone."""
    folders = {}

    def reports(template: str, run: str) -> list[dict]:
        key, names = (template, run), [run]
        if not tiers.FAST:
            key, names = template, LAUNCHES[template]
        if key not in folders:
            folders[key] = tmp_path_factory.mktemp(template)
            launch(template, JOB, tiny_model_dir, str(folders[key]), *names)
        return rank_reports(folders[key] / run)

    return reports


def assert_trains_as(reports, reference, keys) -> None:
    """Both ranks of ``reports`` hold one model, its weights those of ``reference``'s run (within a small share
    of how far training moved them: Adam turns float-order noise into up to ~lr) and its logged ``keys`` too."""
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    moved = [abs(a - b) for a, b in zip(reference[0]["checksum"], reference[0]["initial"])]
    assert reports[0]["checksum"] == pytest.approx(reference[0]["checksum"], rel=1e-5, abs=1e-4 * max(moved))
    for record, expected in zip(reports[0]["history"], reference[0]["history"]):
        for key in keys:
            assert record[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("name, rollout_func", [
    pytest.param("multi_gpu", False, marks=pytest.mark.smoke),  # the fast tier's 2-process DDP GRPO run
    ("zero2", False), ("zero3", False), ("zero3", True)])
def test_grpo_two_processes(name, rollout_func, runs):
    """rollout_func: the job samples through a rollout function (the trainer's own sampling, made-up sampler
    log-probs on one process); everything below holds the same."""
    reports = runs(name, "rollout_func" if rollout_func else "plain")
    assert [r["rank"] for r in reports] == [0, 1] and all(r["num_processes"] == 2 for r in reports)
    assert reports[0]["zero_stage"] == {"multi_gpu": 0, "zero2": 2, "zero3": 3}[name]
    assert reports[0]["shares_prompt_forward"] == (name != "zero3")  # ZeRO-3: one forward per micro-batch

    # Every process sampled the same prompt for round 0, and its group of 4 is split 2 + 2.
    slots = [r["round"]["slots"] for r in reports]
    assert len(set(slots[0] + slots[1])) == 1 and len(slots[0]) == len(slots[1]) == 2
    # The advantages each process holds equal one process's computation over the whole group.
    rewards = torch.tensor(reports[0]["round"]["rewards"] + reports[1]["round"]["rewards"])
    expected, _ = group_advantages(rewards, 4, "group")
    held = reports[0]["round"]["advantages"] + reports[1]["round"]["advantages"]
    assert held == pytest.approx(expected.tolist(), abs=1e-5)
    assert reports[0]["round"]["completions"] != reports[1]["round"]["completions"], "processes must sample apart"
    assert rewards.std() > 0

    # Both processes train one model, log the same metrics, and the KL to the reference is tracked.
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    history = reports[0]["history"]
    local = lambda h: [{k: v for k, v in r.items() if k not in ("step_time", "tokens_per_second")} for r in h]  # noqa: E731  timing is per process
    assert len(history) == 3 and local(history) == local(reports[1]["history"])
    assert all("reward" in r and "kl" in r for r in history)
    assert all(r["rank"] == 0.5 and r["only_rank_1"] == 7.0 for r in history)  # log_metric: over both processes
    assert history[-1]["kl"] > 0
    if rollout_func:  # each call got this process's 2 prompts: one call a round, 3 rounds
        calls = [r["rollout_prompts"] for r in reports]
        assert [len(c) for c in calls] == [3, 3] and all(len(p) == 2 for c in calls for p in c)
        assert calls[0][0] == calls[1][0] == rows_of(reports[0]["round"]["slots"])
        assert all(r["sampling/sampling_logp_difference/mean"] > 1.0 for r in history)  # |log p| under made-up 0s
        # process 1's sequence weights exp(sum log p - 0) are ~0; process 0 (no log-probs, weight 1) counts nothing
        assert all(0.0 <= r["sampling/importance_sampling_ratio/min"] <= r["sampling/importance_sampling_ratio/max"]
                   < 1e-3 for r in history)
    else:
        assert all("sampling/sampling_logp_difference/mean" not in r for r in history)


@pytest.mark.parametrize("name, checkpointing", [("multi_gpu", False), ("zero2", False), ("multi_gpu", True)])
def test_shared_prompt_forward_matches_one_forward_per_row(name, checkpointing, runs):
    """Each process's 2 completions share their prompt's forward (two model calls per micro-batch, under DDP
    or ZeRO-2, and under DDP with gradient checkpointing, whose backward replays the layers on the prompt's
    cache); the first step's loss, gradient norm and KL equal those of one forward per row."""
    shared = runs(name, "checkpointing" if checkpointing else "plain")
    plain = runs(name, "checkpointing_one_forward" if checkpointing else "one_forward")
    assert [r["shares_prompt_forward"] for r in shared] == [True, True]
    assert [r["shares_prompt_forward"] for r in plain] == [False, False]
    for report in shared:  # the policy's and the reference's forwards, every one of them shared
        assert report["shared_forwards"] and all(report["shared_forwards"])
    assert all(not r["shared_forwards"] for r in plain)
    first, reference = shared[0]["history"][0], plain[0]["history"][0]
    for key in ("loss", "grad_norm", "kl", "entropy"):
        assert first[key] == pytest.approx(reference[key], rel=1e-4, abs=1e-7), key
    assert first["grad_norm"] > 0


@pytest.mark.parametrize("name", ["multi_gpu", "zero2"])
def test_skipping_zero_gradient_rows_trains_the_same(name, runs):
    """skip_zero_gradient_rows with rank 0's rows all at advantage 0 while rank 1's are not (rank 0 keeps one row
    in the backward, so the gradient hooks fire on both), and whole groups at 0: the same weights and metrics
    after three steps as training every row."""
    skipped, every = runs(name, "skip"), runs(name, "every")
    assert [r["skips_zero_gradient_rows"] for r in skipped + every] == [True, True, False, False]
    # GRPO's DDP default: no buffer broadcast, so a forward is not a collective (None: DeepSpeed's engine)
    assert skipped[0]["broadcast_buffers"] is {"multi_gpu": False, "zero2": None}[name]
    # the job's hand-made round, then 3 steps of one micro-batch of 2 rows; forwards with gradient come first
    assert [f for f in every[0]["forwards"] if f[1]] == [[2, True]] * 3
    assert [f for f in skipped[0]["forwards"] if f[1]] == [[1, True]] * 3  # rank 0: always all idle
    assert [1, False] in skipped[0]["forwards"]
    assert [2, True] in skipped[1]["forwards"]  # rank 1 trained both rows where its group had a spread
    assert_trains_as(skipped, every, ("loss", "grad_norm", "entropy", "reward"))
    assert any(r["grad_norm"] > 0 for r in every[0]["history"])


def test_top_entropy_quantile_cuts_at_the_quantile_over_both_processes(runs):
    """The entropy cut is one quantile over every process's loss tokens (TRL gathers them), so each process
    keeps its tokens above the shared threshold: not a quarter of its own."""
    reports = runs("multi_gpu", "entropy")
    calls = [r["masks"] for r in reports]
    assert len(calls[0]) == len(calls[1]) == 3  # one micro-batch per step on each process
    uneven = False
    for mine, theirs in zip(*calls):
        both = torch.tensor(mine["entropy"] + theirs["entropy"])
        threshold = torch.quantile(both, 0.75)
        for part in (mine, theirs):
            assert part["kept"] == [bool(e >= threshold) for e in part["entropy"]]
        uneven |= sum(mine["kept"]) != sum(theirs["kept"])
    assert uneven  # the split of kept tokens follows the entropies, not the process


def test_sync_ref_model_mixes_the_sharded_reference_under_zero3(runs):
    """Under ZeRO-3 the reference and the policy are both partitioned: the mix is done on gathered weights
    and every rank ends with ref = 0.5 x the start + 0.5 x the trained policy."""
    reports = runs("zero3", "sync_ref")
    for report in reports:
        assert report["zero_stage"] == 3
        expected = [0.5 * a + 0.5 * b for a, b in zip(report["reference_before"], report["checksum"])]
        assert report["reference_after"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert report["reference_after"] != pytest.approx(report["reference_before"], rel=1e-6)


def test_token_budget_under_zero3_makes_as_many_micro_batches_on_both_processes(runs):
    """token_budget=11 with padding_free: rank 1's rows (6-token completions, 8-11 tokens with their prompts) are
    one micro-batch each, 4 per step; rank 0's (the EOS alone, 3-6 tokens) would fit in two, but it makes 4 too,
    as ZeRO-3's collective forwards need. The same weights and losses as micro-batches of 2 rows (the dapo loss is
    normalized by the step's tokens)."""
    budget, rows = runs("zero3", "budget"), runs("zero3", "rows")
    assert [r["micro_batches"] for r in rows] == [[2, 2, 2]] * 2
    assert [r["micro_batches"] for r in budget] == [[4, 4, 4]] * 2
    assert max(budget[1]["forward_tokens"]) <= 11 and min(budget[1]["forward_tokens"]) >= 8
    rank0 = sorted(budget[0]["forward_tokens"][:4])  # step 1: four single rows, two of which fit together
    assert rank0[0] + rank0[1] <= 11
    assert_trains_as(budget, rows, ("loss", "grad_norm", "kl", "entropy"))
    assert rows[0]["history"][-1]["grad_norm"] > 0
