"""Several sm_90 builds of sass_decode.py / sass_quantize.py (this folder) in one process (one import of torch and
Triton instead of one per build; tests/test_sass.py runs its builds this way).

    echo '[{"script": "decode", "args": ["KBITS=2"], "env": {"R": "128"}}]' | python tests/sass/sass_batch.py

Each job: ``script`` ("decode" or "quantize"), ``args`` (the KEY=VALUE arguments of that script), ``env``
(variables set for this build only, e.g. ``R``, ``S``, ``W``; the rest is this process's environment).
The last line printed is a JSON list with, per job in order, ``{"result": <the script's JSON summary>}`` or
``{"error": <traceback>}``; the scripts' reports go to stderr.
"""

import contextlib
import json
import os
import sys
import traceback
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # a GPU build, before kivi_cache.kernels is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sass_decode  # noqa: E402
import sass_quantize  # noqa: E402

SCRIPTS = {"decode": sass_decode.summary, "quantize": sass_quantize.summary}


def run(job: dict) -> dict:
    env = {k: str(v) for k, v in job.get("env", {}).items()}
    try:
        with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(sys.stderr):
            return {"result": SCRIPTS[job["script"]](list(job.get("args", [])))}
    except Exception:
        return {"error": traceback.format_exc()}


def main():
    jobs = json.loads(sys.stdin.read())
    print(json.dumps([run(job) for job in jobs]))


if __name__ == "__main__":
    main()
