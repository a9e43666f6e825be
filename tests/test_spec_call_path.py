"""How many times a reader following one verify plan through the speculative worker is sent into
another file (issue: at most 25). Measured, not estimated: the calls of one `SpecWorker.step`
are traced; each call site of the package's code that calls into another of its files counts
once (a site in a loop is read once). The models (the target's, the draft head's), attention
and the CPU kernels are entered, not followed: a reader of the worker stops at
`self.model(...)` and `self.draft(...)`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import eaglebatch
from support.fake_scheduler import FakeRequest, FakeScheduler
from support.spec_models import make_draft_dir, make_target_dir, target_worker

PKG = str(Path(eaglebatch.__file__).resolve().parent)
NOT_FOLLOWED = (*(f"{PKG}/{wing}/" for wing in ("model", "attention", "cpu")),
                f"{PKG}/speculative/eagle.py")  # fmt: skip
MOST_ENTRIES = 25


def file_entries(step, plan) -> set[tuple[str, int, str]]:
    """(caller file, caller line, callee file) of every call from one package file into another
    made while `step(plan)` runs, the model's own internals left out."""
    sites: set[tuple[str, int, str]] = set()

    def profile(frame, event, arg):
        callee = frame.f_code.co_filename
        if event != "call" or not callee.startswith(PKG):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(PKG):
            caller = caller.f_back  # through torch's Module.__call__ and the like
        if caller is None or _inside_not_followed(caller):
            return
        if caller.f_code.co_filename != callee:
            sites.add((caller.f_code.co_filename, caller.f_lineno, callee))

    sys.setprofile(profile)
    try:
        step(plan)
    finally:
        sys.setprofile(None)
    return sites


def _inside_not_followed(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith(NOT_FOLLOWED):
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("lookup", [False, True])
def test_one_verify_plan_enters_the_workers_files_at_most_25_times(tmp_path, lookup) -> None:
    from eaglebatch.speculative import SpecWorker

    target = make_target_dir(tmp_path / "target", vocab=64)
    draft = make_draft_dir(tmp_path / "draft", target, "eagle3")
    worker = SpecWorker.from_target(
        target_worker(target), draft, num_steps=3, max_batch_size=4, adaptive=True,
        prompt_lookup=(1, 3) if lookup else None,
    )  # fmt: skip
    reqs = [FakeRequest([1, 2, 3, 1, 2, 3, 1, 2][: 4 + i], 12, 0.0, 1.0, 0, 0) for i in range(3)]
    sched = FakeScheduler(reqs, num_blocks=64, block_size=4, max_batch_size=4, max_model_len=64,
                          max_draft_tokens=worker.max_draft_tokens)  # fmt: skip
    traced: list[set] = []
    original = worker.step

    def step(plan):
        if plan.kind != "verify" or len(traced) == 3:
            return original(plan)
        result = []
        traced.append(file_entries(lambda p: result.append(original(p)), plan))
        return result[0]

    worker.step = step
    sched.run(worker)
    assert traced, "no verify plan ran"
    worst = max(traced, key=len)
    files = sorted({Path(c).relative_to(PKG).as_posix() for _, _, c in worst})
    print(f"{len(worst)} entries into {len(files)} files: {files}")
    assert len(worst) <= MOST_ENTRIES, sorted(worst)
