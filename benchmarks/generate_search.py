"""The max-batch case of benchmarks/generate.py: the largest batch whose ``generate`` fits the memory budget.

Two probe batches give a linear model of peak memory in the batch size and a predicted maximum; the search doubles
its step from there until a trial runs out of memory, then bisects until the bracket is within ``--batch-tol``. A
trial of ``--batch-new`` tokens at the batch found is the row's measurement. Every trial is logged in the row's
``search`` and written to the JSON as it ends, so an interrupted search continues (``--resume``) from its recorded
trials.
"""

from __future__ import annotations

import math
import time

import generate_models as gm
from generate_models import TimeBudget, attempt, base_row, log, skipped_row


def find_max_batch(fits, start: int, cap: int, tol: float, known: dict | None = None):
    """Largest b <= cap with fits(b): doubling steps from ``start`` until a failure brackets it, then
    bisection until hi - lo <= max(1, tol * lo). ``fits`` returns True/False (OOM). Returns (lo, hi).

    ``known``: outcomes already measured ({batch: fits}, e.g. the trials of an interrupted search that is
    resumed). They are never asked of ``fits`` again, and neither is a batch they decide on the search's
    own assumption that fitting is monotone in the batch (at or below a known fit: fits; at or above a
    known failure: does not), so a resumed search walks its recorded steps for free and continues from
    the first batch it has no answer for."""
    known = {int(b): bool(v) for b, v in (known or {}).items()}

    def test(b: int) -> bool:
        if b not in known:
            if any(v and k >= b for k, v in known.items()):
                return True
            if any(not v and k <= b for k, v in known.items()):
                return False
            known[b] = bool(fits(b))
        return known[b]

    lo, hi = 0, None
    b = max(1, min(start, cap))
    step = max(1, int(math.ceil(b * tol))) if start > 1 else 1
    if test(b):
        lo = b
        while lo < cap:
            nb = min(cap, lo + step)
            if test(nb):
                lo, step = nb, step * 2
            else:
                hi = nb
                break
    else:
        hi = b
        while hi > 1:
            nb = max(1, hi - step)
            if test(nb):
                lo = nb
                break
            hi, step = nb, step * 2
    # the tightest bracket the known outcomes give (a recorded fit above the walk's last step, say)
    lo = max([lo] + [k for k, v in known.items() if v and k <= cap])
    hi = min([k for k, v in known.items() if not v and k > lo] + ([hi] if hi is not None and hi > lo else []),
             default=None)
    if lo == 0:
        return 0, hi
    while hi is not None and hi - lo > max(1, math.ceil(tol * lo)):
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def maxbatch_phase(runner, ctx, mname: str, bar):
    args, shapes = runner.args, ctx["shapes"]
    budget = ctx["budget_bytes"]
    for p in args.batch_prompts:
        for cache in args.caches:
            given = runner.given_batch(mname, cache, p)
            if runner.done(mname, "maxbatch", cache, p):
                if given is not None:
                    log(f"--maxbatch-at {mname}:{cache}:{p}:{given}: the row is already finished in the resumed "
                        f"JSON and is kept (not measured again)")
                continue
            bar.set_postfix_str(f"{mname} maxbatch {p} {cache}", refresh=False)
            bar.update(1)
            base = base_row(mname, "maxbatch", cache, None, p, args.batch_new, shapes, args)
            base["budget_bytes"] = budget
            if cache.startswith("quanto") and not runner.quanto["available"]:
                runner.add_row(skipped_row(base, "import", runner.quanto["error"]))
                continue
            key = runner.key(mname, "maxbatch", cache, p)
            if runner.left() < args.min_row_s:
                if key in runner.pending:  # a resumed row (maybe with trials to reuse) stays as it is
                    log(f"{mname} maxbatch {cache} {p}: not started (time budget); its resumed row is kept")
                    continue
                runner.add_row(skipped_row(base, "time budget", "time budget: not started (use --resume)"))
                continue
            prior, note = runner.prior_search(key, budget)
            row = one_max_batch(runner, ctx, base, cache, p, budget, prior=prior, given=given)
            if note:
                row["resume_note"] = note
            runner.add_row(row)


def one_max_batch(runner, ctx, base: dict, cache: str, p: int, budget, prior: dict | None = None,
                  given: int | None = None) -> dict:
    """The max-batch row of one (cache, prompt): probes, search, measurement at the batch found.

    ``prior``: ``{"search": [trial entries], "source": ..., "started": ...}``, the search log of an earlier
    run's unfinished row (``--resume``): its fits and OOMs at this ``--trial-new`` are reused as trials
    (entries marked ``reused``; probes included, so the memory and time models are the recorded ones) and
    the search continues where it stopped. ``given``: no search; measure at this batch (``--maxbatch-at``),
    recorded as ``batch_given``."""
    args, dev = runner.args, runner.dev
    trials: dict[int, dict | None] = {}
    log_trials: list[dict] = []
    ran = []  # generates of this cache in this row (warm-up before a measurement that would be the first)
    resumed = None
    if prior:
        reused, ignored = [], 0
        for e in prior.get("search") or []:
            b = e.get("batch")
            if not isinstance(b, int) or e.get("new") != args.trial_new:
                ignored += 1
                continue
            if e.get("ok") and e.get("t") is not None:
                trials[b] = dict(t=e["t"], peak=e.get("peak"), ttft=e.get("ttft"), step_timer=e.get("step_timer"))
                if e.get("ttft") and b * p >= 512:  # the prefill rate of the time estimates, as if it had run
                    ctx["prefill_rate"] = max(ctx.get("prefill_rate") or 0.0, b * p / e["ttft"])
            elif e.get("oom"):
                trials.setdefault(b, None)  # a recorded fit at the same batch wins
            else:
                ignored += 1
                continue
            log_trials.append(dict(e, reused=True))
            reused.append(b)
        resumed = dict(source=prior.get("source"), started=prior.get("started"), reused_trials=reused,
                       reused_fits=sorted(b for b in set(reused) if trials.get(b) is not None),
                       reused_ooms=sorted(b for b in set(reused) if trials.get(b) is None), ignored_entries=ignored)
        log(f"resume {base['model']} maxbatch {cache} {p}: reusing {len(reused)} recorded trials "
            f"(fits {resumed['reused_fits']}, OOM {resumed['reused_ooms']})")

    def snapshot():  # the row so far, in the JSON after every trial: a command killed mid-search loses nothing
        runner.save_partial(dict(base, status="skipped", skip_reason="interrupted", search=list(log_trials),
                                 trial_new=args.trial_new, resumed=resumed,
                                 error="interrupted during the max-batch search (use --resume: its trials are reused)"))

    def trial(b: int, new: int) -> dict | None:
        t0 = time.perf_counter()
        # a trial of --batch-new tokens keeps the cache's figures: the trial at the batch found is its measurement
        res, err = attempt(lambda: gm.run_generate(ctx, cache, b, p, new, chunked=True,
                                                   keep_cache=new == args.batch_new))
        ran.append(b)
        entry = dict(batch=b, new=new, ok=err is None)
        if err:
            entry.update(err, t_fail=time.perf_counter() - t0)
        else:
            entry.update(t=res["t"], peak=res["peak"], ttft=res.get("ttft"), step_timer=res.get("step_timer"))
        log_trials.append(entry)
        snapshot()
        if err and not err["oom"]:
            raise RuntimeError(err["error"])
        return res

    # probes: a linear model of peak memory and time in the batch size. Both probes run a full
    # --prefill-tokens forward (a chunked prefill keeps it there for larger batches), so the slope is the
    # memory per sequence (KV cache) and not the prefill activations of a growing forward
    b1 = max(1, min(args.max_batch_cap // 2, (args.prefill_tokens or 8 * p) // p))
    b2 = min(args.max_batch_cap, 2 * b1)
    r1 = r2 = None
    try:
        if given is None or b1 in trials:
            r1 = trials[b1] if b1 in trials else trial(b1, args.trial_new)
            if r1 is None and given is None:
                return dict(base, error=f"OOM at batch {b1}", search=log_trials, status="error", resumed=resumed)
            trials[b1] = r1
        if given is None and b2 > b1:
            r2 = trials[b2] if b2 in trials else trial(b2, args.trial_new)
            trials[b2] = r2
    except RuntimeError as exc:
        return dict(base, error=str(exc), search=log_trials, status="error", resumed=resumed)

    def model_of(key):
        if r1 is None or r2 is None or r1.get(key) is None or r2.get(key) is None:
            return None
        slope = (r2[key] - r1[key]) / (b2 - b1)
        return r1[key], slope

    mem, tim = model_of("peak"), model_of("t")

    def largest_fit():
        fit = [b for b, r in trials.items() if r is not None]
        return max(fit) if fit else None

    def est_time(b):
        rate, bl = ctx.get("prefill_rate"), largest_fit()
        ref = r2 or r1 or (trials[bl] if bl else {})
        ests = [0.0]
        if r1 is not None:
            ests += [r1["t"], r1["t"] * b / b1 if tim is None else tim[0] + tim[1] * (b - b1)]
        if rate:  # a first, cold probe can make the linear model too flat
            ests.append(b * p / rate + args.trial_new * (ref.get("step_timer") or 0.0))
        if bl and bl > b2:  # the largest fit past the probes, scaled: the probes' rate is optimistic
            ests.append(trials[bl]["t"] * b / bl)
        return max(ests)

    # the predicted maximum: the line through the smallest and the largest fits (the two probes in a fresh
    # search; a resumed one also has its recorded large fits)
    predicted, predicted_from = None, None
    start = 1
    pts = sorted((b, r["peak"]) for b, r in trials.items() if r is not None and r.get("peak") is not None)
    if (dev.cuda and len(pts) >= 2 and pts[-1][0] > pts[0][0] and budget and not args.no_predict
            and given is None):
        (ba, pa), (bb, pb) = pts[0], pts[-1]
        slope = (pb - pa) / (bb - ba)
        if slope > 0:
            predicted = bb + (budget * 0.98 - pb) / slope  # 2 %: allocator slack below the budget
            predicted_from = [ba, bb]
            start = max(1, int(predicted))
    if r2 is None:
        start = 1

    def fits(b: int) -> bool:  # asked only for batches without a trial (find_max_batch knows the trials)
        est = est_time(b)
        if not runner.fits_in_time(est):
            raise TimeBudget(f"trial at batch {b} (~{est:.0f} s) does not fit the time left ({runner.left():.0f} s)")
        res = trial(b, args.trial_new)
        trials[b] = res
        return res is not None

    def oom_above(b: int) -> int | None:  # the smallest batch above b that ran out of memory
        return min([k for k, r in trials.items() if r is None and k > b], default=None)

    stopped = None
    if given is not None:
        lo = given
        hi = oom_above(given)
    else:
        try:
            lo, hi = find_max_batch(fits, start, args.max_batch_cap, args.batch_tol,
                                    known={b: r is not None for b, r in trials.items()})
        except TimeBudget as exc:
            stopped = str(exc)
            lo = largest_fit() or 0
            hi = oom_above(lo)
        except RuntimeError as exc:
            return dict(base, error=str(exc), search=log_trials, predicted_batch=predicted, status="error",
                        resumed=resumed)
    row = dict(base, batch=lo, batch_oom=hi, predicted_batch=predicted,
               capped=given is None and lo >= args.max_batch_cap, search=log_trials, trial_new=args.trial_new,
               memory_model=None if mem is None else dict(bytes_at_1=mem[0], bytes_per_seq=mem[1]),
               search_stopped_early=stopped, batch_given=given is not None, resumed=resumed)
    if predicted_from and predicted_from != [b1, b2]:
        row["predicted_from"] = predicted_from
    if lo == 0:
        return dict(row, status="error", error="no batch fits the budget")
    tr = trials.get(lo)  # the last fitting trial at that batch (None: a given batch that was never tried)
    if tr and tr.get("cache_stats") is not None:  # a trial of --batch-new tokens at lo: no second generate
        res, err = tr, None
        row["measured_in_search"] = True
    else:
        res, err = measure_at(runner, ctx, cache, p, lo, tr, row, ran, b1, largest_fit, est_time, trials)
        if res is None and err is None:
            return row  # skipped for time (the row says so)
    if err and given is not None and err["oom"]:  # not a finished row: a later --resume can still search
        return dict(row, **err, status="skipped", skip_reason="given batch OOM")
    if err:
        return dict(row, **err, status="error")
    row.update(t_N_s=[res["t"]], t_trial_s=None if not tr or tr is res else tr["t"], step_timer_s=res.get("step_timer"),
               ttft_s=res.get("ttft"), peak_bytes=res["peak"], prefill_chunk=res["prefill_chunk"],
               prefill=res.get("prefill"), decode_alloc=res.get("decode_alloc"), **res.get("cache_stats", {}))
    maxbatch_rates(row, args.batch_new, args.trial_new)
    row.update(best_fit_rate(log_trials, args.batch_new))
    if dev.cuda and budget and res["peak"] and res["peak"] > budget:
        row["note"] = "peak above the budget: the memory fraction was not enforced"
    row["status"] = "ok"
    return row


def measure_at(runner, ctx, cache, p, lo, tr, row, ran, b1, largest_fit, est_time, trials):
    """The throughput generate of a max-batch row at batch ``lo`` (``--batch-new`` tokens, after a warm-up when
    nothing of this cache ran in the row). Returns (result, error); (None, None) when it did not fit the time
    left (``row`` is then marked skipped)."""
    args = runner.args
    if tr:
        est = tr["t"] + (args.batch_new - args.trial_new) * (tr.get("step_timer") or 0.0)
    else:
        rate, bl = ctx.get("prefill_rate"), largest_fit()
        step = (trials[bl].get("step_timer") if bl else None) or 0.1
        est = None if not rate else lo * p / rate + args.batch_new * step
    skipped = dict(status="skipped", skip_reason="time budget",
                   error=f"time budget: measurement at batch {lo} (~{est or 0:.0f} s) did not fit (use --resume)")
    if not ran:  # nothing of this cache ran in this row (recorded probes, a given batch): compile and settle first
        t0 = time.perf_counter()
        wb = min(lo, b1)
        if not runner.fits_in_time((est or 0.0) + (est_time(wb) or 0.0)):
            row.update(skipped)
            return None, None
        _, werr = attempt(lambda: gm.run_generate(ctx, cache, wb, p, 2, chunked=True))
        row["warmup"] = dict(batch=wb, new=2, t=time.perf_counter() - t0, error=None if not werr else werr["error"])
    if not runner.fits_in_time(est):
        row.update(skipped)
        return None, None
    return attempt(lambda: gm.run_generate(ctx, cache, lo, p, args.batch_new, keep_cache=True, chunked=True))


def best_fit_rate(trials: list[dict], n: int) -> dict:
    """The best decode rate among a search's fitting trials of ``n`` new tokens (batch / per-step timer): at its
    largest batch a cache can decode slower than a little below it (allocator retries near the budget), so
    throughput ratios should be taken against the best rate within the budget."""
    rates = [(t["batch"] / t["step_timer"], t["batch"]) for t in trials
             if t.get("ok") and t.get("new") == n and t.get("step_timer")]
    if not rates:
        return {}
    rate, batch = max(rates)
    return dict(best_fit_tok_s=rate, best_fit_batch=batch)


def maxbatch_rates(row: dict, n: int, m: int) -> dict:
    """Decode rates of a max-batch row. The decode step is the per-step timer's median: at these batches a
    generate is mostly a chunked prefill of a million tokens whose time varies by seconds between runs, so
    the difference of two generates ((t_N - t_trial) / (N - trial), kept as ``decode_step_ms_tN``; None
    without a trial at that batch, as with ``--maxbatch-at``) is noise and can come out negative."""
    b, tn, tt, timer = row["batch"], row["t_N_s"][0], row.get("t_trial_s"), row.get("step_timer_s")
    step_tn = (tn - tt) / (n - m) if n > m and tt is not None else None
    row.update(decode_step_ms_tN=None if step_tn is None else step_tn * 1e3,
               decode_step_ms=None if not timer else timer * 1e3, step_ms_timer=None if not timer else timer * 1e3,
               decode_tok_s=None if not timer else b / timer, e2e_tok_s=b * n / tn,
               prefill_s=row.get("ttft_s"),
               step_method="per-step timer (median)")
    return row
