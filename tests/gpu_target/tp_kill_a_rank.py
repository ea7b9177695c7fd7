"""Kill tensor-parallel rank 1 while rank 0 generates; how the engine's process ends is the result.

A child process of tests/gpu_target/test_tensor_parallel.py, since one outcome is the end of
the process itself: `python tests/gpu_target/tp_kill_a_rank.py MODEL_DIR [--device cuda]
[--disable-custom-all-reduce] [--stuck-rank0] [--grace S]` (with the repository on PYTHONPATH).

Once the engine is up and has generated, it prints {"workers": [pids]} and starts a long
generation; once tokens flow, rank 1 is stopped (SIGSTOP), so that rank 0's next step waits
for it, and killed a second later, while rank 0 waits. If `generate` raises RankDiedError it
prints "RankDiedError: ..." and, once the engine's teardown has returned, "teardown returned",
and exits with 3; the watchdog ending a stuck process exits with tp_watchdog.STUCK_EXIT_CODE.

`--stuck-rank0` (for the CPU, whose gloo collectives the abort always frees): marks the
one-shot all-reduce as in use and makes rank 0's next forward block for good, as a thread
waiting for a one-shot kernel that waits for the dead rank does; rank 1 is then killed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

from gpu_target import tp_watchdog
from gpu_target.tp_worker import RankDiedError
from hetero import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--disable-custom-all-reduce", action="store_true")
    parser.add_argument("--stuck-rank0", action="store_true")
    parser.add_argument("--grace", type=float, default=tp_watchdog.STUCK_GRACE_S)
    args = parser.parse_args()
    tp_watchdog.STUCK_GRACE_S = args.grace
    cuda = dict(gpu_memory_utilization=0.3, max_num_seqs=4, max_num_batched_tokens=256) if args.device == "cuda" else {}
    llm = LLM(model=args.model, max_model_len=512, dtype="float32", device=args.device, tensor_parallel_size=2,
              disable_custom_all_reduce=args.disable_custom_all_reduce, **cuda)
    engine = llm.llm_engine
    ranks = engine._ranks
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"workers": [p.pid for p in ranks.processes], "one_shot_in_use": ranks.watchdog.one_shot_in_use}),
          flush=True)
    worker = ranks.processes[0]
    if args.stuck_rank0:
        ranks.watchdog.one_shot_in_use = True
        entered = threading.Event()

        def stuck_forward(chunks):
            entered.set()
            threading.Event().wait()  # never set: the thread waits as for a kernel that never ends

        engine.runner.runner.forward = stuck_forward
        threading.Thread(target=lambda: (entered.wait(), worker.kill()), daemon=True).start()
    else:
        tokens_before = engine.num_generation_tokens_total

        def stop_then_kill():
            while engine.num_generation_tokens_total == tokens_before:
                time.sleep(0.01)
            os.kill(worker.pid, signal.SIGSTOP)
            time.sleep(1.0)  # rank 0 is now waiting for rank 1 in a collective
            worker.kill()

        threading.Thread(target=stop_then_kill, daemon=True).start()
    try:
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), use_tqdm=False)
    except RankDiedError as error:
        print(f"RankDiedError: {error}", flush=True)
    else:
        raise SystemExit("generate returned before rank 1 was killed")
    ranks.close()  # the engine's teardown, as deleting the LLM runs it
    print("teardown returned", flush=True)
    raise SystemExit(3)


if __name__ == "__main__":
    main()
