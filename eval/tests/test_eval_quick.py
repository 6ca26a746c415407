"""Output paths and provenance of the eval scripts: results go to ``eval/results/<eval>_<model>_cpu_<date>.json``,
``--quick`` smoke runs to ``..._quick.json`` (git-ignored), never over a recorded result; an explicit ``--out``
(``--plot``) is kept. Only the argument parsing runs here."""

import datetime
import shutil
import subprocess
from pathlib import Path

import pytest
from eval_scripts import EVAL, load_script

ROOT = EVAL.parent
RESULTS = EVAL / "results"


@pytest.fixture(scope="module")
def perplexity():
    return load_script("perplexity")


@pytest.fixture(scope="module")
def needle():
    return load_script("needle")


def _ignored(path) -> bool:
    out = subprocess.run(["git", "check-ignore", "-q", "--no-index", str(path)], cwd=ROOT, capture_output=True)
    return out.returncode == 0


@pytest.fixture(scope="module")
def git_checkout():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")


def _today() -> str:
    return datetime.date.today().isoformat()


def test_perplexity(perplexity, tmp_path):
    stem = RESULTS / f"perplexity_smollm2_cpu_{_today()}"
    args = perplexity.parse_args(["--quick"])
    assert (Path(args.out), Path(args.plot)) == (Path(f"{stem}_quick.json"), Path(f"{stem}_quick.png"))
    args = perplexity.parse_args([])
    assert (Path(args.out), Path(args.plot)) == (Path(f"{stem}.json"), Path(f"{stem}.png"))
    out, plot = str(tmp_path / "p.json"), str(tmp_path / "p.png")
    args = perplexity.parse_args(["--quick", "--out", out, "--plot", plot])
    assert (args.out, args.plot) == (out, plot)
    args = perplexity.parse_args(["--quick", "--out", str(tmp_path / "q.json")])  # the plot beside the given JSON
    assert Path(args.plot) == tmp_path / "q.png"


def test_needle(needle, tmp_path):
    stem = f"smollm2_cpu_{_today()}"
    paths = needle.output_paths(needle.parse_args(["--quick"]))
    assert paths == (RESULTS / f"needle_{stem}_quick.json", RESULTS / f"needle_{stem}_quick.png")
    paths = needle.output_paths(needle.parse_args(["--quick", "--prefill-chunk", "256"]))
    assert paths == (RESULTS / f"needle_chunk256_{stem}_quick.json", RESULTS / f"needle_chunk256_{stem}_quick.png")
    assert needle.output_paths(needle.parse_args([])) == (RESULTS / f"needle_{stem}.json",
                                                          RESULTS / f"needle_{stem}.png")
    out = tmp_path / "n.json"
    assert needle.output_paths(needle.parse_args(["--quick", "--out", str(out)])) == (out, tmp_path / "n.png")
    plot = tmp_path / "h.png"
    assert needle.output_paths(needle.parse_args(["--quick", "--out", str(out), "--plot", str(plot)])) == (out, plot)
    args = needle.parse_args(["--quick"])
    assert (args.lengths, args.depths) == ("512", "0,100")


def test_needle_cache_names(needle):
    """``--caches`` splits on commas outside brackets; a ``kivi:`` value in brackets is a Python literal."""
    text = "int2,kivi:group_size=32+clip=keys+layer_bits=[(4,2),(2,2)],fp"
    names = needle.split_caches(text)
    assert names == ["int2", "kivi:group_size=32+clip=keys+layer_bits=[(4,2),(2,2)]", "fp"]
    cache = needle.make_cache(names[1])
    assert cache.quant_config.clip == "keys" and cache.quant_config.group_size == 32
    assert [cache.layer_config(i).key_bits for i in range(2)] == [4, 2]


def test_provenance_names_the_command_and_the_commit(perplexity):
    """Every result file starts with the date, the command as run and the commit (``--commit`` wins over git)."""
    p = perplexity.provenance("needle.py", ["--quick", "--caches", "fp,int4"], commit="abc1234")
    assert p["command"] == "python eval/needle.py --quick --caches fp,int4"
    assert p["commit"] == "abc1234"
    assert datetime.datetime.fromisoformat(p["date"]).tzinfo is not None
    assert perplexity.provenance("perplexity.py", [])["commit"]  # git describe, or "unknown" without git
    env = perplexity.environment()
    assert env["versions"]["torch"] and env["python"]


def test_quick_outputs_are_git_ignored(git_checkout, perplexity, needle):
    pa = perplexity.parse_args(["--quick"])
    quick = [pa.out, pa.plot, *needle.output_paths(needle.parse_args(["--quick"])),
             perplexity.result_path("sliding_quality_smollm2", quick=True)]
    assert [p for p in quick if not _ignored(p)] == []
    recorded = [perplexity.parse_args([]).out, *needle.output_paths(needle.parse_args([])),
                perplexity.result_path("sliding_quality_smollm2")]
    assert [p for p in recorded if _ignored(p)] == []
