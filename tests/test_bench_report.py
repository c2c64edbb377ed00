"""docs/benchmarks.md's tables are written from the result files by scripts/bench_report.py: the committed page
must be what its results give, every result file must be cited, and a place with no result says so."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # the docs generator is a script
from bench_report import PAGE, RESULTS, cited, render_page  # noqa: E402


def test_the_page_is_what_its_results_give():
    text = PAGE.read_text()
    assert render_page(text) == text, "run: python scripts/bench_report.py"


def test_every_result_file_is_cited_and_every_link_resolves():
    text = PAGE.read_text()
    files = {p.name for p in RESULTS.glob("*.json")}
    assert files <= cited(text), f"results no page cites (delete them or cite them): {sorted(files - cited(text))}"
    for link in re.findall(r"\]\((bench-results/[^)]+|img/[^)]+)\)", text):
        assert (PAGE.parent / link).is_file(), link


def test_a_block_shows_its_file_or_says_it_is_pending(tmp_path):
    page = ("<!-- bench: spec spec.json -->\nold text\n<!-- /bench -->\n"
            "<!-- bench: spec missing.json -->\n<!-- /bench -->\n")
    result = json.loads((RESULTS / "spec-demo-avx512.json").read_text())
    result["rows"][0]["speedup"] = 9.87
    (tmp_path / "spec.json").write_text(json.dumps(result))
    out = render_page(page, tmp_path)
    assert "old text" not in out and "9.87x" in out and result["command"] in out and result["machine"] in out
    assert "**Pending:**" in out and "docs/bench-results/missing.json" in out
    assert render_page(out, tmp_path) == out                  # idempotent: --check passes right after writing


MEASURED_ONCE = {"chat-cpu.json": "an older engine, kept beside its re-measurement",
                 "serve-lognormal-timed-avx512.json": "a longer variant of the serve run, cited in prose",
                 "host-step-sampler-ab.json": "an A/B of the sampler against the revision before it "
                                              "(scripts/host_step_ab.py)",
                 "host-step-inputs-ab.json": "an A/B of the step's input building against the revision before it",
                 "host-step-scheduler-ab.json": "an A/B of the scheduler's decode fast path against the revision "
                                                "before it",
                 "real-models-2threads-avx2-builds-3repeats.json": "an earlier, shorter run of the AVX2 builds on "
                                                                   "two threads, cited in prose"}


def test_run_benchmarks_writes_every_file_the_page_names():
    script = (ROOT / "scripts" / "run_benchmarks.sh").read_text()
    for name in cited(PAGE.read_text()) - set(MEASURED_ONCE) - {"gpu-check.json"}:   # gpu_check.sh writes that
        stem = name.removesuffix(".json")
        tagged = stem.rsplit("-", 1)[0] + "-$ISA" if stem.endswith(("-avx512", "-avx2")) else stem
        assert f"run {stem} " in script or f'run "{tagged}" ' in script, name
