"""progress.py: the log lines written when stderr is not a terminal; the rate counts from the
first generated token, not from the model load and the first prefills; the ETA is the work left
(prompt tokens to prefill, output tokens expected) at the costs per token measured so far."""

import io
import re

import pytest
from rich.console import Console

from eaglebatch import progress
from eaglebatch.progress import ProgressView, estimate, output_work, prefill_work
from eaglebatch.step_work import StepWork, generation_time, step_cost, token_costs


def _line(view: ProgressView, capsys, done: int, tokens: int) -> str:
    view._last_log = float("-inf")  # log on this call
    view({"requests_done": done, "requests_total": 4, "output_tokens": tokens,
          "running": 4 - done, "waiting": 0})  # fmt: skip
    return capsys.readouterr().err


def test_without_work_counters_the_eta_counts_from_the_first_generated_token(capsys,
                                                                            monkeypatch):
    """A Ray driver's sums have no work counters: the ETA is the request rate's."""
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    view = ProgressView(4, console=Console(file=io.StringIO()), log_every_s=0.0)
    clock[0] += 300.0  # the model loads, the first prompts prefill: nothing generated yet
    first = _line(view, capsys, 0, 0)
    assert "0/4 requests" in first and "ETA unknown" in first
    _line(view, capsys, 0, 4)  # the first tokens
    clock[0] += 10.0
    later = _line(view, capsys, 2, 84)  # half done 10 s after the first token: ~10 s to go
    eta = int(re.search(r"ETA (\d+)s", later).group(1))
    assert "2/4 requests" in later and eta == 10, later
    assert "8.0 output tok/s" in later  # 80 tokens in the 10 s since the first


def test_the_summary_reports_structured_output():
    from eaglebatch.progress import structured_line

    assert structured_line({"structured_rows": 0}) is None
    stats = {"structured_rows": 64, "grammar_compiles": 1, "mask_seconds_p50": 0.0047,
             "mask_seconds_p99": 0.0104, "output_tokens": 1000,
             "drafts": {"forced_accepted": 127}}  # fmt: skip
    assert structured_line(stats) == ("64 rows, 1 grammars compiled, masks 4.70 / 10.40 ms a "
                                      "step (p50 / p99), 12.7% of output tokens forced drafts")


def _counters(**kw) -> dict:
    base = dict(requests_total=0, requests_done=0, requests_error=0, requests_read=0,
                prompt_tokens_read=0, prompt_tokens=0, cached_tokens=0, prefill_tokens=0,
                output_tokens=0, finished_output_tokens=0, requests_stopped=0, running=0,
                waiting=0, max_new_tokens=0, max_batch_size=64,
                step_work={"kinds": {}, "generation": (0,) * 7})  # fmt: skip
    return {**base, **kw}


def test_the_prefill_left_counts_unread_rows_at_the_mean_prompt_read():
    p = _counters(requests_total=10, requests_read=4, prompt_tokens_read=400, prompt_tokens=200,
                  cached_tokens=50, prefill_tokens=100)  # fmt: skip
    w = prefill_work(p)
    # 6 unread rows of 100 tokens; of 200 admitted, 50 cached + 100 computed; the 800 not
    # admitted less the cache's share so far (a quarter)
    assert (w.total, w.done, w.left) == (1000, 150, 50 + 800 * 0.75)
    assert prefill_work(_counters(requests_total=10)) is None  # nothing read: no mean


def test_the_output_left_expects_running_rows_to_be_the_long_ones():
    # nothing stopped yet: every unfinished row runs to the cap (2 running at 30 tokens, 3 more)
    p = _counters(requests_total=6, requests_done=1, running=2, output_tokens=64,
                  finished_output_tokens=4, requests_stopped=0, max_new_tokens=100)  # fmt: skip
    assert output_work(p) == 2 * 70 + 3 * 100
    # one row stopped in 64 tokens: a chance of 1/64 a token; a short finished row does not
    # make the running ones look short (the mean of finished rows would say 4 tokens)
    p["requests_stopped"] = 1
    h = 1 / 64
    want = 2 * (1 - (1 - h) ** 70) / h + 3 * (1 - (1 - h) ** 100) / h
    assert output_work(p) == pytest.approx(want)
    assert output_work(p) > 5 * 4


def test_token_costs_are_measured_where_steps_do_that_work():
    work = {"prefill": (2.0, 1000, 4), "verify": (3.0, 0, 300)}
    assert token_costs(work) == (0.002, 0.01)
    # plain decoding with chunked prefill: mixed steps give the prompt token's cost, the
    # output token's share (from decode steps) taken out
    work = {"decode": (1.0, 0, 100), "mixed": (5.0, 2000, 100)}
    assert token_costs(work) == pytest.approx((0.002, 0.01))
    assert token_costs({"mixed": (3.0, 2000, 1000)}) == (0.001, 0.001)  # pooled
    assert token_costs({}) is None


def test_a_generation_step_costs_a_fixed_part_and_its_output_tokens():
    """The steps' time is fitted as a fixed part plus a part per output token (accepted drafts
    cost about as much as the bonus token); the steps still to run follow the output tokens a
    row gained per step so far and the rows that run at once."""
    work = StepWork()
    out = 0
    for rows in (2, 10, 4, 10):  # 1.5 tokens a row-step; 0.5 s a step + 10 ms an output token
        out += rows * 3 // 2
        work.add("verify", 0.5 + 0.01 * (rows * 3 // 2),
                 {"prefill_tokens": 0, "output_tokens": out}, rows, 4 * rows)  # fmt: skip
    gen = work.snapshot()["generation"]
    assert step_cost(gen) == pytest.approx((0.5, 0.01))
    # 300 tokens = 200 row-steps: 10 steps of 20 rows, or 100 of 2 (fewer rows than the batch)
    assert generation_time(gen, 300, 40, 20) == pytest.approx(10 * 0.5 + 300 * 0.01)
    assert generation_time(gen, 300, 2, 20) == pytest.approx(100 * 0.5 + 300 * 0.01)
    # one step: no fit yet (the estimate takes an output token at a prompt token's cost)
    one = StepWork()
    one.add("verify", 0.3, {"prefill_tokens": 0, "output_tokens": 6}, 4, 16)
    assert generation_time(one.snapshot()["generation"], 300, 40, 20) is None
    # every step as many tokens (plain decoding at one batch size): the time of a step;
    # more output taking less time: the time per output token
    assert step_cost((2, 8, 32, 1.0, 20, 200, 10.0)) == (0.5, 0.0)
    assert step_cost((2, 8, 32, 1.0, 20, 208, 9.0)) == (0.0, 1.0 / 20)


def test_the_eta_follows_output_tokens_when_acceptance_rises():
    """Speculative steps whose acceptance rises over the run (a row gains 1 token a step, then
    4) and cost 50 ms + 2 ms an output token: the time left follows the tokens left, so the
    early steps' low acceptance moves only the fixed part."""
    work, out = StepWork(), 0
    for step in range(10):
        gained = 16 * (1 if step < 5 else 4)
        out += gained
        work.add("verify", 0.05 + 0.002 * gained, {"prefill_tokens": 0, "output_tokens": out},
                 16, 16 * 9)  # fmt: skip
    gen = work.snapshot()["generation"]
    assert step_cost(gen) == pytest.approx((0.05, 0.002))
    truth = 10 * 0.05 + 640 * 0.002  # 640 tokens more at 4 a row-step: 10 steps of 16 rows
    assert 1.0 < generation_time(gen, 640, 16, 16) / truth < 1.2


def _simulated_run(rows=8, prompt=300, cap=40, chunk=512, batch=4, stops=()):
    """A synthetic run (chunked prefill steps alternating with decode steps, a prompt token
    costing 2 ms, a decode step 100 ms + 20 ms a row, rows read two at a time as the scheduler
    asks): [(seconds, progress counters)] after each step."""
    t, out, work = 0.0, [], StepWork()
    lens = [10 if i in stops else cap for i in range(rows)]
    done, gen, computed = set(), [0] * rows, [0] * rows
    p = _counters(requests_total=rows, max_new_tokens=cap, max_batch_size=batch)

    def step(kind, seconds, n):
        nonlocal t
        t += seconds
        work.add(kind, seconds, p, n, n)
        out.append((t, {**p, "step_work": work.snapshot()}))

    while len(done) < rows:
        if p["requests_read"] < min(rows, len(done) + batch + 2):
            p["requests_read"] += 2
            p["prompt_tokens_read"] += 2 * prompt
        live = [i for i in range(rows) if i not in done and computed[i] < prompt][:batch]
        budget, n = chunk, 0
        for i in [i for i in live if i < p["requests_read"]]:
            if len([j for j in range(rows) if 0 < computed[j] and j not in done]) >= batch \
                    and computed[i] == 0:
                break
            p["prompt_tokens"] += prompt if computed[i] == 0 else 0
            k = min(budget, prompt - computed[i])
            computed[i] += k
            budget, n = budget - k, n + k
            if computed[i] == prompt:
                gen[i] = 1
                p["output_tokens"] += 1
        p["prefill_tokens"] += n
        if n:
            step("prefill", 0.002 * n, 1)
        rows_now = [i for i in range(rows) if computed[i] == prompt and i not in done]
        for i in rows_now:
            if gen[i] < lens[i]:
                gen[i] += 1
                p["output_tokens"] += 1
            if gen[i] >= lens[i]:
                done.add(i)
                p["requests_done"] += 1
                p["finished_output_tokens"] += gen[i]
                p["requests_stopped"] += i in stops
        p["running"] = len([i for i in range(rows) if computed[i] > 0 and i not in done])
        if rows_now:
            step("decode", 0.1 + 0.02 * len(rows_now), len(rows_now))
    return out


@pytest.mark.parametrize("stops", [(), (1, 5)])
def test_the_eta_is_within_half_again_of_the_time_left_from_a_fifth_of_the_run(stops):
    run = _simulated_run(stops=stops)
    end = run[-1][0]
    for t, p in run:
        if t < end / 5 or t == end:
            continue
        left, est = end - t, estimate(p)
        assert est is not None and left / 1.5 <= est.seconds <= left * 1.5, (t, est, left)


def test_the_log_line_shows_the_prefill_while_it_takes_longest(capsys, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")  # a line on every update
    view = ProgressView(8, console=Console(file=io.StringIO()))
    p = _counters(requests_total=8, requests_read=8, prompt_tokens_read=8000, prompt_tokens=2000,
                  prefill_tokens=1000, output_tokens=1, max_new_tokens=10,
                  step_work={"kinds": {"prefill": (1.0, 1000, 1)},
                             "generation": (0,) * 7})  # fmt: skip
    view(p)
    line = capsys.readouterr().err
    # 7000 prompt tokens left at 1 ms (7 s), 8 x 10 output tokens at the pooled 1 ms
    assert "prefill 1000/8000 tok, ETA 7s" in line, line
    # 10 generation steps of 1 row took 2 s each: 80 tokens over 8 rows, 10 steps, take 20 s
    p["step_work"] = {"kinds": {"prefill": (1.0, 1000, 1), "decode": (20.0, 0, 10)},
                      "generation": (10, 10, 10, 20.0, 10, 10, 20.0)}  # fmt: skip
    clock[0] += 1
    view(p)
    line = capsys.readouterr().err  # 7 s of prefill, then 20 s
    assert "ETA 27s" in line and "prefill" not in line, line
