"""The soak (scripts/soak.py) as CI runs it: 200 requests with random parameters (n, logprobs,
stop strings, structured outputs, penalties, seeds) and random arrivals against a live server on
127.0.0.1 serving a tiny random model with a real tokenizer, about 30% of them cancelled by
client disconnects. Afterwards nothing may be leaked or drifted: every page free, no live
request, the metrics adding up, RSS after warm-up within its bound, and every finished greedy
request equal to the same request sent again alone."""

from __future__ import annotations

import json

from tests.scripts.conftest import _load_script

NUM_REQUESTS = 200
# Every step shape is compiled before the load (the soak precompiles), so RSS growth after the
# warm-up tenth is what the requests leave behind; the bound is per 1,000 requests, as in the long soak.
MAX_RSS_MB_PER_1000 = 1000  # 180 MB over the counted 180 requests: a leak of more than 1 MB a request fails it


def test_soak_200_requests_with_cancellations(tiny_text_dir, tmp_path):
    soak = _load_script("soak")
    out = tmp_path / "soak.json"
    report = soak.main(["--model", str(tiny_text_dir), "--num-requests", str(NUM_REQUESTS), "--max-num-seqs", "4",
                        "--concurrency", "6", "--max-tokens", "8", "--num-pages", "64",
                        "--max-num-batched-tokens", "64", "--recheck", "20",
                        # a client gives up within 0.2 s: a request of 8 tokens lasts longer than
                        # that on a loaded machine or an idle one, so most chosen to cancel do
                        "--cancel-window", "0.2",
                        "--max-rss-mb-per-1000", str(MAX_RSS_MB_PER_1000), "--out", str(out)])
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, json.dumps({k: report[k] for k in ("checks", "engine", "outcomes", "rss_mb", "mismatches",
                                                          "errors")}, indent=1)[:4000]
    outcomes, engine = report["outcomes"], report["engine"]
    # every request sent ended one way or the other, about 30% of them by the client
    assert sum(outcomes.values()) == NUM_REQUESTS
    assert 0.15 * NUM_REQUESTS < outcomes.get("cancelled", 0) < 0.45 * NUM_REQUESTS
    # the engine saw those that got to it; each one it saw was finished or aborted, none failed
    assert outcomes["finished"] <= engine["received"] <= NUM_REQUESTS
    assert engine["received"] == engine["finished"] + engine["aborted"] and engine["failed"] == 0
    assert engine["free_pages"] == engine["num_pages"] == 64
    assert report["greedy_rechecked"] >= 5  # the equal-alone check compared something
    record = json.loads(out.read_text())
    assert record["provenance"]["command"].startswith("python scripts/soak.py --model")
    assert record["tables"]["soak"]["rows"][0][0] == NUM_REQUESTS


def test_rss_growth_separates_requests_from_compiles():
    soak = _load_script("soak")
    # 0.3 MB a request, 9 MB a compile, compiles tapering off: the fit gives both back
    compiles = [10, 18, 24, 28, 30, 31, 31, 32, 32, 32]
    trace = [(100 * k, 500 + 0.3 * 100 * k + 9 * c, c) for k, c in zip(range(1, 11), compiles)]
    per_1000, per_compile = soak.rss_growth(trace)
    assert abs(per_1000 - 300) < 1e-6 and abs(per_compile - 9) < 1e-9
    # no compiles at all: the growth is the slope alone
    per_1000, per_compile = soak.rss_growth([(100 * k, 700 + 2.0 * k, 5) for k in range(1, 11)])
    assert abs(per_1000 - 20) < 1e-9 and per_compile == 0.0
