"""A long-lived eaglebatch process for the race tests (test_run_races.py): it reads one JSON
command per line on stdin and answers one JSON line, so that many interleavings cost no
interpreter start each. Commands (each after sleeping `sleep` seconds):

- {"argv": [...]}: `eaglebatch ARGV` in this process; answers {"rc": exit status};
- {"argv": [..., "--ray"], "fake_ray": true}: the same with Ray replaced by FakeRay, which runs
  each actor call at once in this process (the driver's real cut, unit directories, dispatch
  and busy-unit waiting; the actors' real unit runs and locks);
- {"unit": [start, end], "job": JOB}: what an engine actor of an earlier, dead driver does with
  the unit it was given: runs it (EngineActor.run_unit); answers {"result": ...}.
The CLI's own output goes to stderr; answers go to the original stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


class FakeRef:
    def __init__(self, fn, *args):
        try:
            self.value, self.error = fn(*args), None
        except Exception as e:  # noqa: BLE001 - delivered at get(), as Ray does
            self.value, self.error = None, e


class FakeRay:
    """The part of the Ray API the executor uses, synchronous and in-process."""

    class exceptions:  # noqa: N801 - ray.exceptions
        class RayError(Exception):
            pass

    def __init__(self):
        self.up = False

    def init(self, **_):
        self.up = True

    def is_initialized(self):
        return self.up

    def shutdown(self):
        self.up = False

    def cluster_resources(self):
        return {"CPU": 2}

    def remote(self, **_):
        def wrap(cls):
            class Handle:
                @classmethod
                def remote(cls_, *args):
                    obj = cls(*args)
                    return _Actor(obj)

            return Handle

        return wrap

    def get(self, ref):
        if ref.error is not None:
            raise self.exceptions.RayError(str(ref.error))
        return ref.value

    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs), []


class _Actor:
    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        method = getattr(self.obj, name)

        class Method:
            @staticmethod
            def remote(*args):
                return FakeRef(method, *args)

        return Method


def _cli(argv: list[str], fake_ray: bool) -> int:
    from eaglebatch import ray_executor
    from eaglebatch.cli import main

    real = ray_executor.import_ray
    if fake_ray:
        ray_executor.import_ray = FakeRay
    try:
        main.main(args=argv, prog_name="eaglebatch", standalone_mode=True)
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        ray_executor.import_ray = real
    return 0


def _orphan_unit(job: str, start: int, end: int) -> dict:
    from eaglebatch.job.config import load_job
    from eaglebatch.prepare import prepare
    from eaglebatch.ray_executor import EngineActor, Unit

    actor = EngineActor(prepare(load_job(job)))
    result = actor.run_unit(Unit(start, end, np.empty(0, np.int64)))
    return {k: v for k, v in result.items() if k != "stats"}


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the CLI's prints go to stderr
    for line in sys.stdin:
        cmd = json.loads(line)
        time.sleep(cmd.get("sleep", 0))
        if "unit" in cmd:
            answer = {"result": _orphan_unit(cmd["job"], *cmd["unit"])}
        else:
            answer = {"rc": _cli(cmd["argv"], cmd.get("fake_ray", False))}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
