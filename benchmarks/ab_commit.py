"""A/B speed check of this tree ("cur") against an earlier commit ("base"), both in one Python process on one GPU.

Purpose: a change of the library (a redesign, a refactor) must not change its speed. Both packages are imported side
by side (the base renamed ``kivi_base``); every measurement alternates base and cur; a row reports each side's median
and ``ratio = cur / base``. Rows:

1. ``decode``: ``ops.paged_decode_attention`` (backend forced to ``"triton"``) as CUDA-graph replays, batch x KV
   heads x context in 8x8x32768, 32x8x32768, 8x32x32768, 1x8x131072, 8x8x131072, query heads 4 x KV heads, head_dim
   128, bits (key/value/group) 4/4/32, 2/2/32, 4/2/64; plus fp16 SDPA per shape as a control (the same torch call on
   both sides: its ratio is the measurement's noise, not a verdict);
2. ``quant``: ``quantize_and_write`` of a 32-token group flush and of a 1k-token prefill write (batch 32, 8 KV heads,
   head_dim 128), and ``append_and_flush`` (the compiled step's cache op) with every window flushing;
3. ``e2e``: ``generate`` on a random-weight Llama-3-8B-shaped fp16 model (``--layers`` of its 32 layers, default 8,
   each of the full shape; the JSON says how many): the eager batch-1 step at 1k context with ``Int4PagedCache()``
   and the step ``generate`` compiles for ``StaticQuantizedPagedCache``, batch 1, 1k and 32k context. A generate's
   step time: the median interval between consecutive tokens' logits (CUDA events recorded by a logits processor,
   no sync added), the first step left out. Each package drives its own model (a deep copy sharing the weights) set
   to its own hook's attention name (``kivi`` / ``kivi_base``), so each cache is served by its own hook.

Outputs are compared on the same inputs (timing two implementations that compute different things means nothing):
op outputs, written pages, generated tokens and logits. Pass: the outputs agree (``max_rel_diff`` = max|base - cur| /
max(1, max|cur|) per output tensor <= ``--atol``, about two fp16 ulps; equal tokens; expected: bit-identical) and
``|ratio - 1| <= --tol`` (3%); else the status is MISMATCH, SLOWER or FASTER (a change either way is reported).

Usage (``prepare`` needs git, ``run`` does not)::

    python benchmarks/ab_commit.py prepare --commit 8bae978 --dir .ab/base
    python benchmarks/ab_commit.py run --base-dir .ab/base --out ab.json [--cur-commit SHA] [--parts ...] [--quick]
    TRITON_INTERPRET=1 python benchmarks/ab_commit.py run --base-dir .ab/base --quick --out /tmp/ab.json  # CPU smoke

``prepare`` exports ``kivi_cache/`` and ``kernels/`` of the commit (``git archive``) as the package ``kivi_base``
(``kivi_base/kernels`` = its ``kernels/``), rewrites ``kivi_cache`` to ``kivi_base`` in every file (imports,
``torch.library`` op namespaces, messages), renames its attention hook ``kivi_base`` and its attribute on attention
modules ``_kivi_base_static``, and writes the commit to ``DIR/COMMIT``. On a GPU machine with the repository (about
5 minutes with 8 layers; ``--parts decode,quant`` and ``--parts eager,static`` split it, e.g. for ``--layers 32``)::

    PYTHONPATH=$PWD python benchmarks/ab_commit.py run --base-dir .ab/base --out ab_commit.json --cur-commit <sha>

``--quick``: tiny shapes and a 2-layer model, a CPU smoke run under ``TRITON_INTERPRET=1`` (no CUDA graphs, no
compile; wall-clock times that are no speed result: status ``agree`` or ``MISMATCH``). Leave ``KIVI_*`` variables
unset (the base reads launch settings from them). The JSON is written after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time

import torch
from harness import StepClock, machine_info
from harness import time_alternating as time_ab  # CUDA-graph replays measured in turns

T0 = time.perf_counter()
SHAPES = "8x8x32768,32x8x32768,8x32x32768,1x8x131072,8x8x131072"
PARTS = ("decode", "quant", "eager", "static")
REWRITES = ((re.compile(r"kivi_cache"), "kivi_base"),  # package, imports, op namespaces, messages
            (re.compile(r"_kivi_static"), "_kivi_base_static"))  # the static cache's attribute on attention modules
HOOK_NAME = re.compile(r'^NAME = "kivi"$', re.M)  # hook.py: the attention function's registered name


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def prepare(args) -> None:
    """Export the commit's ``kivi_cache/`` and ``kernels/`` as the package ``DIR/kivi_base``, renamed."""
    sha = subprocess.run(["git", "rev-parse", f"{args.commit}^{{commit}}"], check=True, capture_output=True,
                         text=True).stdout.strip()
    tar = subprocess.run(["git", "archive", "--format=tar", sha, "kivi_cache", "kernels"], check=True,
                         capture_output=True).stdout
    if os.path.exists(args.dir):
        shutil.rmtree(args.dir)
    pkg, files, subs = os.path.join(args.dir, "kivi_base"), 0, 0
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf.getmembers():
            top, _, rest = m.name.partition("/")
            if not m.isfile() or not rest or (top == "kivi_cache" and rest.split("/")[0] == "kernels"):
                continue  # folders; links (a kivi_cache/kernels link, where a commit tracks one)
            dest = os.path.join(pkg, rest) if top == "kivi_cache" else os.path.join(pkg, "kernels", rest)
            data = tf.extractfile(m).read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None:
                for pat, new in REWRITES:
                    text, n = pat.subn(new, text)
                    subs += n
                if m.name == "kivi_cache/hook.py":
                    text, n = HOOK_NAME.subn('NAME = "kivi_base"', text)
                    if n != 1:
                        raise SystemExit(f"prepare: {sha[:10]}'s kivi_cache/hook.py has {n} lines 'NAME = \"kivi\"' "
                                         f"(expected 1): see how this commit names its attention hook")
                data = text.encode("utf-8")
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(data)
            files += 1
    with open(os.path.join(args.dir, "COMMIT"), "w") as f:
        f.write(sha + "\n")
    print(f"prepared {pkg} from {sha}: {files} files, {subs} renames, attention hook 'kivi_base'")


def load_packages(base_dir: str, quick: bool):
    """``(kivi_base, kivi_cache)``, each with its own attention hook; the interpreter on for a CPU quick run."""
    if quick and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (transformers imports it)
    set_vars = sorted(k for k in os.environ if k.startswith("KIVI_"))
    if set_vars:
        log(f"WARNING: {set_vars} set: the base commit reads KIVI_* launch settings from the environment")
    import kivi_cache as cur

    sys.path.insert(0, os.path.abspath(base_dir))
    import kivi_base as base
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    cur_fn, base_fn = (ALL_ATTENTION_FUNCTIONS[hook_name(p)] for p in (cur, base))
    # base's install() wrapped cur's "sdpa" wrapper: its pass-through gets transformers' sdpa again and "sdpa" cur's
    # wrapper (neither model below uses "sdpa": each its package's own name)
    if base.hook._original_sdpa is cur_fn:
        base.hook._original_sdpa = sdpa_attention_forward
        AttentionInterface.register("sdpa", cur_fn)
    assert hook_name(base) != hook_name(cur) and base_fn is not cur_fn, "one attention function for both packages"
    assert hasattr(torch.ops.kivi_base, "paged_decode_attention"), "base's custom ops are not under kivi_base::"
    return base, cur


def pool_args(ops, tensors) -> tuple:
    """The pool's six tensors as ``ops`` takes them: one argument (a tuple) where its ops have a ``pool`` parameter,
    six positional arguments where they take ``*pool`` (earlier commits)."""
    param = inspect.signature(ops.paged_decode_attention).parameters.get("pool")
    takes_one = param is not None and param.kind != param.VAR_POSITIONAL
    return (tuple(tensors),) if takes_one else tuple(tensors)


def hook_name(pkg) -> str:
    """The attention implementation name that the package's hook registers."""
    return getattr(pkg.hook, "NAME", "kivi")


@contextlib.contextmanager
def kernels_forced(*pkgs):
    """The packages' ``ops`` on the backend ``"triton"`` (the kernels, also on the CPU under the interpreter, or an
    error; never the torch path) meanwhile. ``<pkg>.ops`` is the op API both versions have, with the same signatures
    (where the kernels' own module lives changes)."""
    prev = [p.get_backend() for p in pkgs]
    for p in pkgs:
        p.set_backend("triton")
    try:
        yield
    finally:
        for p, b in zip(pkgs, prev, strict=True):
            p.set_backend(b)


def make_pool(b, hkv, t_quant, d, p, g, kb, vb, dev, gen):
    """Random pool of ``b`` sequences of ``t_quant`` quantized tokens on scattered pages: ``(block_table, lengths,
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)``, the ops' argument order."""
    t_quant = t_quant // g * g
    pps = -(-t_quant // p)
    npg = max(1, b * pps)
    h = dict(device=dev, dtype=torch.float16, generator=gen)
    kc = torch.randint(0, 256, (npg, hkv, p, d * kb // 8), dtype=torch.uint8, device=dev, generator=gen)
    vc = torch.randint(0, 256, (npg, hkv, d, p * vb // 8), dtype=torch.uint8, device=dev, generator=gen)
    ks, kz = torch.rand(npg, hkv, p // g, d, **h) * (2.0 / (1 << kb)), torch.randn(npg, hkv, p // g, d, **h) - 1
    vs, vz = torch.rand(npg, hkv, d // g, p, **h) * (2.0 / (1 << vb)), torch.randn(npg, hkv, d // g, p, **h) - 1
    bt = torch.randperm(npg, device=dev, generator=gen).to(torch.int32)[: b * pps].reshape(b, pps).contiguous()
    return bt, torch.full((b,), t_quant, dtype=torch.int32, device=dev), kc, ks, kz, vc, vs, vz


def max_diff(xs, ys) -> tuple[float, float]:
    """``(max |x - y|, max over the pairs of max |x - y| / max(1, max |y|))``: base's outputs ``xs`` against cur's."""
    d = [(float((x.float() - y.float()).abs().max()), float(y.float().abs().max()))
         for x, y in zip(xs, ys, strict=True)]
    return max(a for a, _ in d), max(a / max(1.0, m) for a, m in d)


class Bench:
    def __init__(self, args, base, cur, dev):
        self.args, self.base, self.cur, self.dev = args, base, cur, dev
        self.kb, self.kc = base.ops, cur.ops  # the op API of each
        self.rows, self.notes, self._models = [], [], None
        self.reps = 2 if args.quick else args.rounds
        commit_file = os.path.join(args.base_dir, "COMMIT")
        base_commit = open(commit_file).read().strip() if os.path.exists(commit_file) else "unknown"
        self.meta = dict(benchmark="ab_commit", command=" ".join([sys.executable, *sys.argv]), quick=args.quick,
                         commits=dict(base=base_commit, cur=args.cur_commit), machine=machine_info(dev),
                         packages=dict(base=base.__file__, cur=cur.__file__), tolerance=args.tol, atol=args.atol,
                         kernel_error=dict(base=base.kernel_error(), cur=cur.kernel_error()),
                         timing=("ops: CUDA graph replays (events), alternating; e2e: CUDA events between steps"
                                 if dev.type == "cuda" else "CPU wall clock (smoke run: no speed result)"))

    def save(self, complete: bool) -> None:
        if self.args.out:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
            with open(self.args.out, "w") as f:
                json.dump(dict(self.meta, complete=complete, notes=self.notes, rows=self.rows), f, indent=1)

    def add(self, part, name, times, diff, unit="ms", agree=True, **extra) -> None:
        """One row; ``diff``: :func:`max_diff` of base's and cur's outputs (None: nothing to compare)."""
        b, c = statistics.median(times["base"]), statistics.median(times["cur"])
        ratio = c / b if b > 0 else float("nan")
        diff, rel = diff if diff is not None else (None, None)
        agree = agree and (rel is None or rel <= self.args.atol)
        if not agree:
            status = "MISMATCH"
        elif self.dev.type != "cuda":  # a CPU smoke run checks the outputs, not the speed
            status = "agree"
        else:
            status = "ok" if abs(ratio - 1) <= self.args.tol else "SLOWER" if ratio > 1 else "FASTER"
        self.rows.append(dict(part=part, name=name, unit=unit, base=b, cur=c, ratio=ratio, status=status,
                              passed=status in ("ok", "agree"), max_abs_diff=diff, max_rel_diff=rel,
                              base_rounds=times["base"], cur_rounds=times["cur"], **extra))
        log(f"{part:6} {name:36} base {b:9.4f} cur {c:9.4f} {unit}  x{ratio:.3f}  max|diff| "
            f"{'-' if diff is None else f'{diff:.2e}'}  {status}")
        self.save(False)

    def guarded(self, part: str, name: str, fn, *a) -> None:
        """``fn(*a)``; an exception becomes an ERROR row and the run goes on."""
        try:
            fn(*a)
        except Exception as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {str(exc)[:500]}"
            log(f"{part:6} {name}: ERROR {msg}")
            self.rows.append(dict(part=part, name=name, status="ERROR", passed=False, error=msg))
            self.save(False)
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ 1. decode attention
    def decode(self) -> None:
        with kernels_forced(self.base, self.cur):
            self._decode()

    def _decode(self) -> None:
        d, res, page = (64, 32, 64) if self.args.quick else (128, 128, 64)
        for shape in self.args.shapes.split(","):
            b, hkv, ctx = map(int, shape.split("x"))
            gen = torch.Generator(device=self.dev).manual_seed(0)
            q = torch.randn(b, 4 * hkv, d, device=self.dev, dtype=torch.float16, generator=gen)
            for bits in self.args.bits.split(","):
                self.guarded("decode", f"{shape} {bits}", self.decode_row, shape, q, ctx, res, page, bits, gen)
            self.guarded("decode", f"{shape} fp16 sdpa", self.sdpa_row, shape, q, ctx, gen)

    def decode_row(self, shape, q, ctx, res, page, bits, gen) -> None:
        kb, vb, g = map(int, bits.split("/"))
        (b, hq, d), hkv = q.shape, q.shape[1] // 4
        pool = make_pool(b, hkv, ctx - res, d, page, g, kb, vb, self.dev, gen)
        rk = torch.randn(b, hkv, res + g, d, device=self.dev, dtype=torch.float16, generator=gen)
        rv = torch.randn_like(rk)
        rl = torch.full((b,), res, device=self.dev, dtype=torch.int32)
        kw = dict(res_k=rk, res_v=rv, res_lengths=rl, key_bits=kb, value_bits=vb, group_size=g, sm_scale=d ** -0.5)
        bt, lens, *tensors = pool
        call = lambda ops: ops.paged_decode_attention(q, bt, lens, *pool_args(ops, tensors), **kw)
        diff = max_diff([call(self.kb)], [call(self.kc)])
        times = time_ab({"base": lambda: call(self.kb), "cur": lambda: call(self.kc)}, self.dev, self.reps)
        self.add("decode", f"{shape} k{kb}v{vb}g{g}", times, diff, batch=b, kv_heads=hkv, q_heads=hq, context=ctx,
                 head_dim=d, key_bits=kb, value_bits=vb, group_size=g, residual=res, page_size=page)

    def sdpa_row(self, shape, q, ctx, gen) -> None:
        (b, hq, d), hkv = q.shape, q.shape[1] // 4
        kf = torch.randn(b, hkv, ctx, d, device=self.dev, dtype=torch.float16, generator=gen)
        vf = torch.randn_like(kf)
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kf, vf, enable_gqa=True)
        self.add("decode", f"{shape} fp16 sdpa (control)", time_ab({"base": fn, "cur": fn}, self.dev, self.reps),
                 None, batch=b, kv_heads=hkv, q_heads=hq, context=ctx, head_dim=d, control=True)

    # ------------------------------------------------------------------ 2. quantize and write
    def quant(self) -> None:
        with kernels_forced(self.base, self.cur):
            self._quant()

    def _quant(self) -> None:
        b, h, d, g, page, r, s = (2, 2, 64, 32, 64, 32, 4) if self.args.quick else (32, 8, 128, 32, 64, 128, 4)
        prompt = 256 if self.args.quick else 1024
        gen = torch.Generator(device=self.dev).manual_seed(1)
        bt, _, *pool = make_pool(b, h, (prompt // page + 1) * page, d, page, g, 4, 4, self.dev, gen)
        shape = dict(batch=b, kv_heads=h, head_dim=d, group_size=g, page_size=page)
        for n_tok, what in ((g, f"flush b{b}"), (prompt, f"prefill {b}x{prompt}")):
            label = f"quantize_and_write {what}"
            self.guarded("quant", label, self.write_row, label, bt, pool, n_tok, shape, gen)
        self.guarded("quant", f"append_and_flush b{b}", self.flush_row, bt, pool, prompt, r, s, shape, gen)

    def write_row(self, label, bt, pool, n_tok, shape, gen) -> None:
        """``quantize_and_write`` of every sequence's first ``n_tok`` tokens (``n_tok / G`` groups each)."""
        b, h, d, g, page = (shape[k] for k in ("batch", "kv_heads", "head_dim", "group_size", "page_size"))
        k = torch.randn(b * n_tok // g, h, g, d, device=self.dev, dtype=torch.float16, generator=gen)
        v = torch.randn_like(k)
        grp = torch.arange(n_tok // g, device=self.dev)
        pages = bt[:, grp * g // page].reshape(-1).contiguous()
        slots = ((grp * g) % page).repeat(b).to(torch.int32)
        call = lambda ops, t: ops.quantize_and_write(k, v, pages, slots, *pool_args(ops, t), key_bits=4, value_bits=4,
                                                     group_size=g)
        copies = [[t.clone() for t in pool] for _ in range(2)]
        call(self.kb, copies[0])
        call(self.kc, copies[1])
        times = time_ab({"base": lambda: call(self.kb, pool), "cur": lambda: call(self.kc, pool)}, self.dev, self.reps)
        self.add("quant", label, times, max_diff(*copies), groups=k.shape[0], **shape)

    def flush_row(self, bt, pool, prompt, r, s, shape, gen) -> None:
        """``append_and_flush`` at a step where every sequence's window is full: a group quantized each call."""
        b, h, d, g = (shape[k] for k in ("batch", "kv_heads", "head_dim", "group_size"))
        rk = torch.randn(b, h, s + r + g, d, device=self.dev, dtype=torch.float16, generator=gen)
        rv = torch.randn_like(rk)
        nk = torch.randn(b, h, d, device=self.dev, dtype=torch.float16, generator=gen)
        nv = torch.randn_like(nk)
        lens = [torch.full((b,), x, device=self.dev, dtype=torch.int32) for x in (s + r + g - 1, s, prompt)]
        call = lambda ops, t, wk, wv: ops.append_and_flush(nk, nv, wk, wv, *lens, bt, *pool_args(ops, t), key_bits=4,
                                                            value_bits=4, group_size=g, residual_length=r,
                                                            sink_length=s)
        outs = []
        for ops in (self.kb, self.kc):
            t, wk, wv = [x.clone() for x in pool], rk.clone(), rv.clone()
            call(ops, t, wk, wv)
            outs.append([*t, wk, wv])
        times = time_ab({"base": lambda: call(self.kb, pool, rk, rv), "cur": lambda: call(self.kc, pool, rk, rv)},
                        self.dev, self.reps)
        self.add("quant", f"append_and_flush b{b} (flushing)", times, max_diff(*outs), residual=r, sinks=s, **shape)

    # ------------------------------------------------------------------ 3. end to end
    def models(self):
        """(base model, cur model): one random-weight Llama and a deep copy sharing its parameters, each set to
        its package's attention name."""
        if self._models is None:
            from transformers import LlamaConfig, LlamaForCausalLM

            a = self.args
            shape = (dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000) if a.quick else
                     dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.layers,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
            cfg = LlamaConfig(**shape, max_position_embeddings=131072, attn_implementation="sdpa",
                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
            torch.manual_seed(0)
            prev = torch.get_default_dtype()
            torch.set_default_dtype(torch.float16)
            try:
                with torch.device(self.dev):
                    mc = LlamaForCausalLM(cfg).eval().requires_grad_(False)
            finally:
                torch.set_default_dtype(prev)
            mb = copy.deepcopy(mc, memo={id(p): p for p in mc.parameters()})
            assert all(x is y for x, y in zip(mb.parameters(), mc.parameters(), strict=True)), "weights not shared"
            for m, pkg in ((mb, self.base), (mc, self.cur)):
                m.set_attn_implementation(hook_name(pkg))
                assert m.config._attn_implementation == hook_name(pkg)
                m.generation_config.pad_token_id, m.generation_config.eos_token_id = 0, None  # always `new` tokens
            note = ("tiny 2-layer model (quick)" if a.quick else
                    f"Llama-3-8B shape with {a.layers} of its 32 layers, random weights, fp16")
            self.meta["model"] = dict(shape, note=note, attn=dict(base=mb.config._attn_implementation,
                                                                  cur=mc.config._attn_implementation))
            log(f"model: {note}")
            self._models = (mb, mc)
        return self._models

    def generate(self, pkg, model, ids, cache, new):
        from transformers import LogitsProcessorList

        clock = StepClock(self.dev.type == "cuda")
        gc.collect()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **pkg.cache_kwargs(model, cache),
                                 max_new_tokens=new, do_sample=False, logits_processor=LogitsProcessorList([clock]),
                                 return_dict_in_generate=True, output_logits=True)
        return clock.steps_ms(), out

    def e2e(self, label: str, make_cache, ctx: int, new: int, rounds: int, warm: int) -> None:
        mb, mc = self.models()
        ids = torch.randint(3, mc.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(2))
        ids = ids.to(self.dev)
        sides, outs = {"base": (self.base, mb), "cur": (self.cur, mc)}, {}
        times, steps = {"base": [], "cur": []}, {"base": [], "cur": []}
        for n, (pkg, m) in sides.items():
            t = time.perf_counter()
            for _ in range(warm):  # (a compiled step: its compile, then the retrace a second cache object may cause)
                outs[n] = self.generate(pkg, m, ids, make_cache(pkg, m), new)[1]
            log(f"  {label}: {n} warm-up {time.perf_counter() - t:.1f} s")
        for r in range(rounds):
            for n in ("base", "cur") if r % 2 == 0 else ("cur", "base"):
                d, outs[n] = self.generate(*sides[n], ids, make_cache(*sides[n]), new)
                times[n].append(statistics.median(d))  # a generate's median step
                steps[n].append([round(x, 3) for x in d])
        same = bool(torch.equal(outs["base"].sequences, outs["cur"].sequences))
        compiled = {n: hasattr(m, "_compiled_call") for n, (_, m) in sides.items()}
        if label.startswith("compiled") and self.dev.type == "cuda" and not all(compiled.values()):
            self.notes.append(f"{label}: generate did not compile the step: {compiled}")
            log(f"  WARNING {self.notes[-1]}")
        if not same:
            log(f"  {label}: the generated tokens differ between base and cur")
        diff = max_diff([torch.stack(outs["base"].logits)], [torch.stack(outs["cur"].logits)])
        self.add("e2e", label, times, diff, unit="ms/step", agree=same, context=ctx, new_tokens=new, batch=1,
                 tokens_equal=same, compiled=compiled, layers=mc.config.num_hidden_layers, steps_ms=steps)

    def eager(self) -> None:
        ctx, new = (256, 8) if self.args.quick else (1024, 64)
        self.guarded("e2e", "eager", self.e2e, f"eager Int4PagedCache b1 ctx{ctx}",
                     lambda pkg, m: pkg.Int4PagedCache(), ctx, new, 1 if self.args.quick else self.args.e2e_rounds, 1)

    def static(self) -> None:
        new = 8 if self.args.quick else 48
        if self.dev.type == "cuda":
            cfg = torch._dynamo.config
            cfg.automatic_dynamic_shapes = False  # each compile specialised to its shapes, whichever model came first
            for name in ("recompile_limit", "cache_size_limit"):  # room for two models x two contexts
                if hasattr(cfg, name):
                    setattr(cfg, name, max(64, getattr(cfg, name)))
            self.notes.append("static: torch._dynamo automatic_dynamic_shapes=False, recompile limit 64")
        else:
            self.notes.append("static: not compiled on the CPU (generate compiles on GPUs only)")
        for ctx in (256, 512) if self.args.quick else (1024, 32768):
            self.guarded("e2e", f"static ctx{ctx}", self.e2e, f"compiled static b1 ctx{ctx}",
                         lambda pkg, m, ctx=ctx: pkg.StaticQuantizedPagedCache(m, ctx + new), ctx, new,
                         1 if self.args.quick else self.args.e2e_rounds, 1 if self.args.quick else 2)

    def table(self) -> None:
        m = self.meta["machine"]
        print(f"\nbase {self.meta['commits']['base'][:12]} vs cur {self.meta['commits']['cur'][:12]} on "
              f"{m.get('gpu') or 'CPU (quick smoke run: times are no speed result)'}")
        print(f"{'part':6} {'row':38} {'base':>10} {'cur':>10} {'unit':>7} {'ratio':>6} {'max|diff|':>9}  status")
        for r in self.rows:
            if "base" not in r:
                print(f"{r['part']:6} {r['name']:38} {r['status']:>57}")
                continue
            diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
            print(f"{r['part']:6} {r['name']:38} {r['base']:10.4f} {r['cur']:10.4f} {r['unit']:>7} "
                  f"{r['ratio']:6.3f} {diff:>9}  {r['status']}")
        rows = [r for r in self.rows if not r.get("control")]
        print(f"{sum(r['passed'] for r in rows)} of {len(rows)} rows pass (outputs agree"
              + (f", |ratio - 1| <= {self.args.tol:.0%}" if self.dev.type == "cuda" else "")
              + f"); fp16 SDPA controls (noise): {[round(r['ratio'], 3) for r in self.rows if r.get('control')]}")


def run(args) -> None:
    base, cur = load_packages(args.base_dir, args.quick)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.quick:
        raise SystemExit("no CUDA device: use --quick for the CPU smoke run")
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(set(parts) - set(PARTS))} (parts: {PARTS})")
    if args.quick and args.shapes == SHAPES:
        args.shapes = "2x2x256,1x2x512"
    bench = Bench(args, base, cur, dev)
    m = bench.meta["machine"]
    log(f"base {bench.meta['commits']['base'][:12]} ({base.__file__}) vs cur {args.cur_commit} ({cur.__file__}) on "
        f"{m.get('gpu') or m.get('cpu')}, driver {m.get('driver', '-')}; torch {m['torch']} triton {m['triton']} "
        f"transformers {m['transformers']}; attention hooks {hook_name(base)!r} / {hook_name(cur)!r}")
    for p in PARTS:
        if p in parts:
            log(f"--- {p}")
            getattr(bench, p)()
    bench.save(True)
    bench.table()
    if args.out:
        log(f"saved {args.out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="export a commit's kivi_cache/ and kernels/ as the package kivi_base")
    p.add_argument("--commit", required=True)
    p.add_argument("--dir", default=".ab/base")
    r = sub.add_parser("run", help="the A/B (GPU; --quick: tiny CPU smoke run)")
    r.add_argument("--base-dir", default=".ab/base", help="what prepare wrote (kivi_base/, COMMIT)")
    r.add_argument("--out", default=None, help="JSON, written after every row")
    r.add_argument("--cur-commit", default="unknown", help="the current tree's commit, for the record")
    r.add_argument("--quick", action="store_true", help="tiny shapes and model: CPU smoke run")
    r.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    r.add_argument("--shapes", default=SHAPES, help="decode shapes, BxKVxCTX (query heads 4 x KV)")
    r.add_argument("--bits", default="4/4/32,2/2/32,4/2/64", help="decode settings, key/value/group")
    r.add_argument("--rounds", type=int, default=15, help="alternating graph replays per op row and side")
    r.add_argument("--e2e-rounds", type=int, default=5, help="timed generates per end-to-end row and side")
    r.add_argument("--layers", type=int, default=8, help="decoder layers of the Llama-3-8B-shaped model (of 32)")
    r.add_argument("--tol", type=float, default=0.03, help="pass band of |cur / base - 1|")
    r.add_argument("--atol", type=float, default=2e-3, help="outputs agree while max|base - cur| <= atol x "
                   "max(1, max|cur|) (2e-3: about two fp16 ulps)")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
