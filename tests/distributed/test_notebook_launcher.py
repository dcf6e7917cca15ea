"""Both trainers under Accelerate's notebook_launcher on CPU (2 forked processes, the trainer built inside the
launched function): one model trained by DDP over gloo, the same as `accelerate launch` of the same job; the
launch's mixed_precision honoured; what cannot run that way refused with a clear error instead of a hang."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, free_port, launch, rank_reports

JOB = os.path.join(REPO, "tests", "distributed", "notebook_job.py")


def notebook(method: str, model_dir: str, folder, *options: str, threads: int = 1,
             check: bool = True) -> subprocess.CompletedProcess:
    """``python notebook_job.py notebook METHOD ...``: the job calls notebook_launcher(num_processes=2)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, JOB, "notebook", method, model_dir, str(folder), f"port={free_port()}", *options]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    # a timeout, not a hang of the suite, if a forked process ever waits forever
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"notebook job failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-8000:]}")
    return result


def assert_one_trained_model(reports: list[dict]) -> None:
    """Both ranks ran DDP over gloo and hold the same weights, moved from the initial ones."""
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["num_processes"] == 2
        assert report["distributed_type"] == "DistributedType.MULTI_CPU"
    assert reports[0]["checksum"] == pytest.approx(reports[1]["checksum"], rel=1e-9)
    assert reports[0]["losses"] == reports[1]["losses"] and len(reports[0]["losses"]) == 3
    moved = [abs(a - b) for a, b in zip(reports[0]["checksum"], reports[0]["initial"])]
    assert max(moved) > 1e-3, "training changed no weight"


@pytest.mark.distributed
def test_notebook_launcher_trains_one_model_like_accelerate_launch(tiny_model_dir, tmp_path):
    """SFT then GRPO in one notebook_launcher launch (a new trainer each, as a notebook's cells would), then the same
    under `accelerate launch` (multi_gpu.yaml: DDP over gloo here): each trains one model, to the same numbers."""
    notebook("sft,grpo", tiny_model_dir, tmp_path / "notebook")
    (tmp_path / "launch").mkdir()
    launch("multi_gpu", JOB, "direct", "sft,grpo", tiny_model_dir, str(tmp_path / "launch"))
    for method, batch in (("sft", 8), ("grpo", 4)):  # per-device 2 x 2 processes (x 2 accumulation)
        reports = rank_reports(tmp_path / "notebook" / method)
        assert_one_trained_model(reports)
        assert all(r["effective_batch_size"] == batch and r["mixed_precision"] == "no" for r in reports)
        if method == "grpo":
            assert reports[0]["rewards"] == reports[1]["rewards"] and len(reports[0]["rewards"]) == 3
        launched = rank_reports(tmp_path / "launch" / method)
        assert_one_trained_model(launched)
        assert reports[0]["losses"] == pytest.approx(launched[0]["losses"], rel=1e-5, abs=1e-6)
        assert reports[0]["rewards"] == pytest.approx(launched[0]["rewards"], rel=1e-5)
        assert reports[0]["checksum"] == pytest.approx(launched[0]["checksum"], rel=1e-5, abs=1e-6)


@pytest.mark.distributed
def test_notebook_launcher_refuses_fp16_on_cpu(tiny_model_dir, tmp_path):
    """fp16, which Accelerate would run as float32 on CPU, is refused on both processes (bf16 reaching the trainer
    is test_fork_after_torch_ran_threads's)."""
    result = notebook("sft", tiny_model_dir, tmp_path, "mixed_precision=fp16", "bf16=none", check=False)
    assert result.returncode != 0
    assert "fp16 mixed precision needs a GPU" in result.stdout + result.stderr
    assert not list(tmp_path.glob("**/report-*.json"))


@pytest.mark.distributed
@pytest.mark.parametrize("import_trainers", [True, False])
def test_fork_after_torch_ran_threads(import_trainers, tiny_model_dir, tmp_path):
    """The notebook ran a torch op on 2 OpenMP threads before launching, and each forked process trains with 2
    threads: with trainers imported in the notebook, its fork hook releases OpenMP's pool and training runs;
    without it the forked processes would hang at their first step (GNU OpenMP is not fork-safe), so the trainer
    refuses to start and says what to do. The launch asks for bf16 (notebook_launcher(mixed_precision="bf16")) and
    the config leaves bf16 to it: bf16 reaches both trainers (Accelerate itself never reads the variable the
    launcher sets)."""
    options = ["parent_threads=2", f"import_trainers={int(import_trainers)}", "mixed_precision=bf16", "bf16=none"]
    result = notebook("sft", tiny_model_dir, tmp_path, *options, threads=2, check=import_trainers)
    if import_trainers:
        reports = rank_reports(tmp_path / "sft")
        assert_one_trained_model(reports)
        assert [r["mixed_precision"] for r in reports] == ["bf16", "bf16"]
    else:
        assert result.returncode != 0
        output = result.stdout + result.stderr
        assert "GNU OpenMP (torch's) is not fork-safe" in output and "`import trainers` in the notebook" in output
