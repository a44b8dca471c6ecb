"""Run by tests/interop/test_hf_export_vllm.py in .venv-vllm (vLLM's own venv, see
tests/interop/requirements-vllm.txt), never imported by the test suite:

    .venv-vllm/bin/python tests/interop/vllm_logprobs.py SPEC.json RESULT.json

SPEC.json is a list of {"model": DIR, "input_ids": [[int]], "vocab": V}. For each, vLLM loads DIR as
is (`vllm.LLM(model=DIR, dtype="float32", enforce_eager=True)`, on the CPU) and scores each row of
input_ids as a prompt, asking for every token's log-probability (`prompt_logprobs=V`) at each
position and a greedy next token with its V log-probabilities: row b's `logprobs[i]` is vLLM's
log-softmax over the vocabulary after input_ids[b][: i + 1], so i runs over all the prompt's
positions, as the training model's logits do. RESULT.json: a list, per model, of
{"rows": [{"logprobs": [[V floats] per position], "next": int}], "load_s": float, "run_s": float}.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec_path, result_path = sys.argv[1], sys.argv[2]
    specs = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = []
    for spec in specs:
        t0 = time.monotonic()
        vocab = spec["vocab"]
        llm = LLM(
            model=spec["model"],
            dtype="float32",
            enforce_eager=True,
            max_model_len=64,
            max_logprobs=vocab,
            seed=0,
        )
        t1 = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab, logprobs=vocab)
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["input_ids"]], params)
        rows = []
        for out in outs:
            # prompt_logprobs[0] is None (nothing precedes the first token); entry i (i >= 1) is
            # the distribution of token i, i.e. after tokens [0, i); the sampled token's logprobs
            # are the distribution after the whole prompt
            dists = list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]]
            logprobs = []
            for dist in dists:
                full = [None] * vocab
                for tok, lp in dist.items():
                    full[int(tok)] = lp.logprob
                logprobs.append(full)
            rows.append({"logprobs": logprobs, "next": out.outputs[0].token_ids[0]})
        results.append({"rows": rows, "load_s": t1 - t0, "run_s": time.monotonic() - t1})
        del llm
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    # vLLM's engine core starts a process of its own unless told not to (the test's environment
    # sets VLLM_ENABLE_V1_MULTIPROCESSING=0); under spawn it re-imports this module, hence the guard
    main()
