"""The batch-1 cases of benchmarks/generate.py (short, long, ctx), the memory arithmetic of a long row, and the
decode profile (``--profile``).

Short and long: every configuration is warmed up with one generate, then ``--repeats`` measurements are
interleaved across configurations, the order reversed every other repeat. A measurement is a generate of N new
tokens (t_N) and one of 1 new token (t_1): decode step = (t_N - t_1) / (N - 1), prefill = t_1, medians over the
repeats. ctx: one cold run per prompt length (peak memory against context length).
"""

from __future__ import annotations

import generate_models as gm
import torch
from generate_models import attempt, base_row, human, log, skipped_row
from harness import median as med
from transformers import StoppingCriteria, StoppingCriteriaList

from kivi_cache import cache_kwargs

# kernel names that would mean decode attention ran outside kivi_cache's kernels
ATTENTION_LIKE = ("flash", "fmha", "sdpa", "scaled_dot_product", "attention", "attn", "efficient")


def batch1_phase(runner, ctx, mname: str, bar):
    """Cases short / long (warm-up, then interleaved repeats) and ctx (one cold run each)."""
    args, shapes, dev = runner.args, ctx["shapes"], runner.dev
    cfgs = []
    if "short" in args.cases:
        cfgs += [("short", c, args.prompt, args.new) for c in args.caches]
    if "long" in args.cases:
        cfgs += [("long", c, args.long_prompt, args.long_new) for c in args.caches]
    todo, meas = [], {}
    for case, cache, p, n in cfgs:
        if runner.done(mname, case, cache, p):
            continue
        base = base_row(mname, case, cache, 1, p, n, shapes, args)
        if cache.startswith("quanto") and not runner.quanto["available"]:
            runner.add_row(skipped_row(base, "import", runner.quanto["error"]))
            bar.update(1 + args.repeats)
            continue
        todo.append((case, cache, p, n, base))
    # warm-up, one generate per configuration
    alive = []
    for case, cache, p, n, base in todo:
        wn = min(n, 40 if p <= 4096 else 8)
        bar.set_postfix_str(f"{mname} warm-up {case} {cache}", refresh=False)
        res, err = attempt(lambda c=cache, p=p, wn=wn, n=n: gm.run_generate(ctx, c, 1, p, wn, cache_len=p + n))
        bar.update(1)
        if err:
            runner.add_row(dict(base, **err, phase="warm-up"))
            bar.update(args.repeats)
            continue
        # cost of one measurement: t_N + t_1
        step = res.get("step_timer") or 0.0
        est = 2 * res.get("ttft", res["t"]) + (n - 1) * step
        meas[(case, cache)] = dict(base=base, tN=[], t1=[], peakN=[], heldN=[], peak1=[], timerN=[], ttft=[], est=est,
                                   stats=None, errors=[], warmup_s=res["t"])
        alive.append((case, cache, p, n))
    # static caches again: a compiled step is re-traced when another configuration's warm-up changed what its
    # guards check (binding a StaticQuantizedPagedCache to the model's attention modules does, once)
    for case, cache, p, n in alive:
        if cache.endswith("static"):
            bar.set_postfix_str(f"{mname} warm-up 2 {case} {cache}", refresh=False)
            attempt(lambda c=cache, p=p, n=n: gm.run_generate(ctx, c, 1, p, min(n, 8), cache_len=p + n))
    # interleaved repeats, alternating the order
    for r in range(args.repeats):
        order = alive if r % 2 == 0 else alive[::-1]
        for case, cache, p, n in order:
            m = meas[(case, cache)]
            bar.set_postfix_str(f"{mname} {case} {cache} rep {r + 1}/{args.repeats}", refresh=False)
            if m["errors"]:
                bar.update(1)
                continue
            if not runner.fits_in_time(m["est"]):
                m.setdefault("time_skipped", 0)
                m["time_skipped"] += 1
                bar.update(1)
                continue
            first = m["stats"] is None
            res, err = attempt(lambda c=cache, p=p, n=n, k=first: gm.run_generate(ctx, c, 1, p, n, keep_cache=k,
                                                                                  cache_len=p + n))
            if err:
                m["errors"].append(err)
                bar.update(1)
                continue
            if m["stats"] is None:
                m["stats"] = res.get("cache_stats")
            m["tN"].append(res["t"])
            m["peakN"].append(res["peak"])
            m["heldN"].append(res["held_before"])
            m["timerN"].append(res.get("step_timer"))
            m["ttft"].append(res.get("ttft"))
            res1, err = attempt(lambda c=cache, p=p, n=n: gm.run_generate(ctx, c, 1, p, 1, cache_len=p + n))
            if err:
                m["errors"].append(err)
            else:
                m["t1"].append(res1["t"])
                m["peak1"].append(res1["peak"])
            bar.update(1)
    for case, cache, _p, n in alive:
        m = meas[(case, cache)]
        row = dict(m["base"], repeats=len(m["tN"]), t_N_s=m["tN"], t_1_s=m["t1"], warmup_s=m["warmup_s"])
        if m["tN"] and m["t1"]:
            tn, t1 = med(m["tN"]), med(m["t1"])
            step = (tn - t1) / (n - 1) if n > 1 else None
            row.update(prefill_s=t1, ttft_s=med(m["ttft"]), decode_step_ms=None if step is None else step * 1e3,
                       decode_tok_s=None if not step or step <= 0 else 1 / step,
                       e2e_tok_s=n / tn, step_ms_timer=None if med(m["timerN"]) is None else med(m["timerN"]) * 1e3,
                       peak_bytes=max(m["peakN"]) if dev.cuda else None,
                       held_before_bytes=m["heldN"][m["peakN"].index(max(m["peakN"]))] if dev.cuda else None,
                       peak_prefill_bytes=max(m["peak1"]) if dev.cuda and m["peak1"] else None)
            row.update(m["stats"] or {})
        if m["errors"]:
            row.update(m["errors"][0], status="error" if not m["tN"] else "ok")
            if m["tN"]:
                row["note"] = f"{len(m['errors'])} repeat(s) failed: " + m["errors"][0]["error"]
                row["error"] = None
        elif not m["tN"]:
            row.update(status="skipped", skip_reason="time budget",
                       error="time budget: no measurement fitted in the time left (use --resume)")
        elif m.get("time_skipped"):
            row["note"] = f"{m['time_skipped']} repeat(s) skipped for the time budget"
        runner.add_row(row)
        if case == "long" and row.get("status") == "ok":
            memory_arithmetic(runner, ctx, row)
    # ctx: peak memory against context length, one cold run each
    if "ctx" in args.cases:
        rate = ctx.get("prefill_rate")  # tokens / s
        for p in args.ctx_prompts:
            for cache in args.caches:
                if runner.done(mname, "ctx", cache, p):
                    continue
                base = base_row(mname, "ctx", cache, 1, p, args.ctx_new, shapes, args)
                bar.set_postfix_str(f"{mname} ctx {p} {cache}", refresh=False)
                bar.update(1)
                if cache.startswith("quanto") and not runner.quanto["available"]:
                    runner.add_row(skipped_row(base, "import", runner.quanto["error"]))
                    continue
                est = None if not rate else p / rate + args.ctx_new * 0.06
                if not runner.fits_in_time(est):
                    runner.add_row(skipped_row(base, "time budget", "time budget (use --resume)"))
                    continue
                res, err = attempt(lambda c=cache, p=p: gm.run_generate(ctx, c, 1, p, args.ctx_new, keep_cache=True))
                if err:
                    runner.add_row(dict(base, **err))
                    continue
                runner.add_row(dict(base, t_N_s=[res["t"]], ttft_s=res.get("ttft"), peak_bytes=res["peak"],
                                    step_ms_timer=None if res.get("step_timer") is None else res["step_timer"] * 1e3,
                                    note="single cold run (memory)", **res.get("cache_stats", {})))


def act_estimate(shapes: dict, batch: int, prompt: int) -> int:
    """Activation bytes at the prefill peak (last layer's MLP): 3 [P, I] + 3 [P, H] tensors."""
    elt = shapes["kv_bytes_per_token_fp"] // (2 * shapes["layers"] * shapes["kv_heads"] * shapes["head_dim"])
    return batch * prompt * elt * (3 * shapes["intermediate_size"] + 3 * shapes["hidden_size"])


def memory_arithmetic(runner, ctx, row: dict):
    shapes = ctx["shapes"]
    w = shapes["weight_bytes"]
    kv = row.get("kv_bytes_allocated") or 0
    act = act_estimate(shapes, row["batch"], row["prompt"])
    peak = row.get("peak_bytes")
    kind = "allocated, memory_report()" if row["cache"].startswith("kivi") else "held"
    line = (f"memory @ b={row['batch']}, {row['prompt']}+{row['new']} tokens, {row['model']} {row['cache']}: "
            f"weights {human(w)} + KV {human(kv)} ({kind}) + activations ~{human(act)} (est.) = {human(w + kv + act)}")
    held = row.get("held_before_bytes")
    other = max(0, held - w) if held else 0  # allocations the process held before this generate besides weights
    if peak:
        line += f"; measured peak {human(peak)} (unexplained {human(peak - w - kv - act - other)}"
        line += f", after {human(other)} held before the generate besides the weights)" if held else ")"
    runner.memory_lines.append(line)
    row["memory_arithmetic"] = dict(weights=w, kv=kv, activations_est=act, sum=w + kv + act, measured_peak=peak,
                                    held_before=held, held_before_besides_weights=other)
    log(line)


# ----------------------------------------------------------------------------- profile

def kivi_kernel_names() -> list[str]:
    """The names of the Triton kernels in ``kivi_cache.kernels`` (the profile tags them ``kivi``)."""
    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415

    names = []
    try:
        import kivi_cache.kernels as pkg  # noqa: PLC0415

        for info in pkgutil.iter_modules(pkg.__path__):
            try:
                mod = importlib.import_module(f"kivi_cache.kernels.{info.name}")
            except Exception:  # noqa: BLE001
                continue
            for name, obj in vars(mod).items():
                if type(obj).__name__ in ("JITFunction", "Autotuner", "Heuristics") and name.endswith("kernel"):
                    names.append(name)
    except Exception:  # noqa: BLE001
        pass
    return sorted(set(names)) or ["_decode_split_kernel", "_decode_reduce_kernel", "_quantize_write_kernel"]


def profile_phase(runner, ctx, mname: str) -> dict:
    """torch.profiler over ``--profile-steps`` decode steps of kivi-int4 at batch 1 (prefill not recorded)."""
    from torch.profiler import ProfilerActivity, profile, schedule  # noqa: PLC0415

    args, dev, model = runner.args, runner.dev, ctx["model"]
    steps, p = args.profile_steps, args.prompt
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    captured = []
    ids = gm.prompt_ids(1, p, model.config.vocab_size, dev.device)

    class Step(StoppingCriteria):
        def __init__(self, prof):
            self.prof = prof

        def __call__(self, input_ids, scores, **kwargs):
            dev.sync()
            self.prof.step()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def run():
        cache = gm.make_cache("kivi-int4", model, 1, p + steps + 3, args, runner.quanto)
        gm.run_generate(ctx, "kivi-int4", 1, p, 8)  # warm
        with profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                     on_trace_ready=lambda pr: captured.append(pr.events())) as prof:
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                               max_new_tokens=steps + 3, min_new_tokens=steps + 3, do_sample=False, pad_token_id=0,
                               stopping_criteria=StoppingCriteriaList([Step(prof)]))
        return True

    _, err = attempt(run)
    if err:
        return dict(model=mname, **err)
    if not captured:
        return dict(model=mname, error="the profiler captured no events")
    events = captured[-1]
    ours = kivi_kernel_names()
    agg: dict[str, list] = {}
    device_kind = "cuda" if dev.cuda else "cpu"

    def add(name, us):
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += us

    for e in events:
        if dev.cuda:
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
                add(e.name, e.time_range.elapsed_us())
        elif not e.name.startswith("ProfilerStep"):  # CPU: self time of each op
            add(e.name, e.self_cpu_time_total)
    if dev.cuda and not agg:  # profilers whose kernels hang off their CPU ops
        for e in events:
            for k in getattr(e, "kernels", []) or []:
                add(k.name, k.duration)
    total = sum(v[1] for v in agg.values()) or 1.0
    table = []
    for name, (calls, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        low = name.lower()
        tag = "kivi" if any(k in name for k in ours) else (
            "attention-like" if any(k in low for k in ATTENTION_LIKE) else "")
        table.append(dict(name=name, calls=calls, total_us=us, share=us / total, us_per_step=us / steps, tag=tag))
    attn_like = [r["name"] for r in table if r["tag"] == "attention-like"]
    res = dict(model=mname, cache="kivi-int4", batch=1, prompt=p, decode_steps=steps, events=device_kind,
               total_us_per_step=total / steps, kivi_kernels=ours,
               kivi_share=sum(r["share"] for r in table if r["tag"] == "kivi"),
               attention_like_kernels=attn_like, top=table[: args.profile_top])
    log(f"\nprofile: {mname} kivi-int4, batch 1, prompt {p}, {steps} decode steps ({device_kind} events), "
        f"{total / steps / 1e3:.2f} ms of {device_kind} time per step")
    log(f"  {'kernel':<70}{'calls':>7}{'us/step':>10}{'share':>8}  tag")
    for r in table[: args.profile_top]:
        nm = r["name"] if len(r["name"]) <= 68 else r["name"][:65] + "..."
        log(f"  {nm:<70}{r['calls']:>7}{r['us_per_step']:>10.1f}{100 * r['share']:>7.1f}%  {r['tag']}")
    log("  decode attention kernels outside kivi_cache: " + (", ".join(attn_like) if attn_like else "none"))
    return res
