"""One process of the multi-host fault tests (2 processes x 1 host device on 127.0.0.1, TP = 2):
process 0 streams one long greedy request and prints a line per token, then the error it got,
if any; process 1 follows. The test kills one of them mid-generation.

    python -m tests.parallel.mh_fault_worker COORDINATOR PROCESS_ID MODEL_DIR XLA_CACHE_DIR PEER_TIMEOUT_S
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    coordinator, process_id, source, cache, peer_timeout = argv[0], int(argv[1]), argv[2], argv[3], float(argv[4])
    from paxpage import multihost, xla_cache

    multihost.initialize(coordinator, 2, process_id, timeout_s=60, peer_timeout_s=peer_timeout)
    xla_cache.enable(cache)  # the tests after the first compile nothing
    import paxpage

    model = paxpage.load(source)
    config = paxpage.EngineConfig(tensor_parallel_size=2, num_pages=72, page_size=4, max_num_seqs=1,
                                  max_num_batched_tokens=16, prefill_row_len=4)
    if not multihost.is_leader():
        print("following", flush=True)
        model.engine(config).runner.follow()
        return
    try:
        for k, _ in enumerate(paxpage.stream(model, [[1, 2, 3]], engine_config=config, max_tokens=250,
                                             temperature=0, ignore_eos=True)):
            print(f"token {k}", flush=True)
    except Exception as e:  # noqa: BLE001 - what the request got is the test's to judge
        sys.stdout.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")  # one write: one line
        sys.stdout.flush()
        raise
    model.engine(config).runner.stop_followers()


if __name__ == "__main__":
    main(sys.argv[1:])
