"""Asynchronous GRPO (async_generation) against a real vLLM server: `trainers vllm-serve` started once for this
module (as tests/integration/test_vllm_server.py starts it), the runs in processes of their own
(tests/integration/vllm_async_job.py; bound 0 and bound 1 share one). Bound 0 is the synchronous run exactly;
bound 1 learns the digits task with rounds at most one step stale, each token tagged with the weights that
sampled it; two processes under ZeRO-3 each sample their own
rows; a server stopped mid-run (SIGSTOP: a stalled transfer) and a server killed mid-run each stop the run within
the stated timeouts with a checkpoint. The tests run in file order: the last one kills the server."""

import os

import pytest

from tests.conftest import against, free_port, launch, rank_reports, reports_of_one_job, run_job
from tests.integration.test_vllm_server import group_members, serve

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_async_job.py")


@pytest.fixture(scope="module")
def server(vllm_python, tmp_path_factory):
    yield from serve(vllm_python, tmp_path_factory)


def job(out, mode, server, *extra) -> dict:
    return run_job(JOB, mode, server.url, server.model_dir, str(free_port()), str(out), *map(str, extra),
                   report=os.path.join(out, "report.json"))


@pytest.fixture(scope="module")
def together(server, tmp_path_factory):
    """``together(mode)``: the report of exact or learn, both run once for the module in one process."""
    return reports_of_one_job(JOB, ["exact", "learn"], tmp_path_factory, against(server))


def test_bound_zero_is_the_synchronous_run(together):
    """max_staleness=0: every round sampled with the weights of the step that trains on it, by the same seeds, so
    4 asynchronous steps end with the synchronous run's weights, bit for bit."""
    report = together("exact")
    assert report["async"] == report["sync"]
    assert [r["sample/staleness_max"] for r in report["records"]] == [0.0] * 4
    # train()'s closing record as TRL's: step 4 was logged, so no trainer metric is pending (each reward once)
    assert "train_runtime" in report["closing"] and not {"reward", "sample/staleness_max"} & set(report["closing"])


def test_bound_one_learns_with_every_round_one_step_stale(together):
    """24 steps of the digits task with max_staleness=1 (AsyncGRPOTrainer, TRL's argument order): the reward rises
    as in the synchronous run (test_vllm_server.py), each round after the first sampled at most one step before
    the step that trains on it, its lag seen by the sampler's log-probs. Exactly one step for most rounds, not all:
    a producer thread that only starts a round after the step's weight push (a busy host: seen once in a clean
    run, at step 16) samples it with the newer weights, within the bound."""
    report = together("learn")
    records = report["records"]
    rewards = [r["reward"] for r in records]
    print(f"\nasync GRPO, bound 1, 24 steps: {report['seconds']:.1f} s; rewards {[round(r, 2) for r in rewards]}")
    assert rewards[0] < 0.1 and sum(rewards[-4:]) / 4 > 0.5, rewards
    staleness = [r["sample/staleness_max"] for r in records]
    assert staleness[0] == 0.0 and set(staleness) <= {0.0, 1.0} and staleness.count(1.0) >= 18, staleness
    for name in ("sample/staleness_mean", "sample/rollout_queue_size", "perf/rollout_wait_s",
                 "rollout/backpressure_s", "perf/weight_sync_s", "perf/weight_sync_wait_s"):
        assert all(name in r for r in records), name
    # one optimizer step of lag: the sampler's log-probs differ from the policy's that trains on them
    assert sum(r["sampling/sampling_logp_difference/mean"] for r in records[1:]) / 23 > 1e-3
    # the producer samples through the token route (in_flight_weight_updates, the default): every token tagged
    # with its weights, within the bound of the step that trains on it and never newer, never going back within a
    # completion; model_version the round's oldest token's (sampled across a push: tests/integration/
    # test_vllm_server.py, test_a_request_in_flight_goes_on_across_a_paused_weight_update)
    for record in report["completions"]:
        tokens = [v for v, start, end in record["version_spans"] for _ in range(start, end)]
        trained_at = record["step"] - 1  # the optimizer step whose round it is
        assert tokens and all(trained_at - 1 <= v <= trained_at for v in tokens), record["version_spans"]
        assert tokens == sorted(tokens) and record["model_version"] <= tokens[0]
    assert all("sample/updated_in_flight" in r for r in records)


def test_two_processes_under_zero3_sample_their_own_rows(server, tmp_path):
    """2 processes, ZeRO-3, max_staleness=1, 3 steps: each process's producer sends its own rows; the weights are
    pushed by the main process from both processes' shards; both processes end with the same weights and metrics."""
    launch("zero3", JOB, "zero3", server.url, server.model_dir, str(free_port()), str(tmp_path), timeout=600)
    reports = rank_reports(tmp_path)
    assert [r["is_main_process"] for r in reports] == [True, False]
    assert reports[0]["weights"] == reports[1]["weights"]
    for report in reports:
        assert [r["sample/staleness_max"] for r in report["records"]] == [0.0, 1.0, 1.0]
    assert [r["reward"] for r in reports[0]["records"]] == [r["reward"] for r in reports[1]["records"]]


def test_a_stalled_server_stops_the_run_with_a_checkpoint_that_resumes(server, tmp_path):
    """The server is stopped (SIGSTOP) after step 2, in the middle of the producer's next round: with
    request_timeout=5 and weight_sync_timeout=5 the run stops within seconds, naming the server, with a checkpoint
    of step 2; the server continues and the checkpoint resumes asynchronously."""
    report = job(tmp_path, "stall", server, server.process.pid)
    print(f"\nserver stopped after step 2: the run stopped {report['seconds_to_stop']:.1f} s after it started")
    assert report["error_type"] in ("VLLMServerError", "GenerationError"), report
    assert server.url in report["error"] or "producer" in report["error"], report["error"]
    assert "Training stopped after step 2; checkpoint written to" in report["error"]
    assert report["steps_done"] == 2 and "checkpoint-2" in report["checkpoints"]
    assert report["seconds_to_stop"] < 60
    assert report["resumed_steps"] == [1, 2, 3, 4]


def test_a_killed_server_stops_the_run_with_a_checkpoint(server, tmp_path):
    """The server is killed after step 2: the producer's requests and the next weight push fail, and every
    process stops with a VLLMServerError naming the server and a checkpoint of step 2."""
    report = job(tmp_path, "die", server, server.process.pid)
    print(f"\nserver killed after step 2: the run stopped {report['seconds_to_stop']:.1f} s after it started")
    assert report["error_type"] == "VLLMServerError" and server.url in report["error"], report
    assert "Training stopped after step 2; checkpoint written to" in report["error"]
    assert report["steps_done"] == 2 and "checkpoint-2" in report["checkpoints"]
    assert report["seconds_to_stop"] < 60
    assert group_members(server.process.pid) == []
