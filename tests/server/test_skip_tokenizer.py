"""A server started with --skip-tokenizer-init serves token-id prompts, logprobs included."""
from __future__ import annotations

import httpx

from pagedserve import LLM, SamplingParams
from server_process import start_server, stop_server


def test_logprobs_without_a_tokenizer_name_tokens_by_id(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    prompt = [5, 17, 42, 99, 7]
    ref = LLM(str(model), device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=256,
              num_gpu_blocks_override=64).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2),
        use_tqdm=False)[0].outputs[0]
    server = start_server(model, tmp_path / "server.log", "--skip-tokenizer-init", "--max-model-len", "256",
                          "--num-gpu-blocks-override", "64")
    try:
        r = httpx.post(server.v1 + "/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
        want = [step[t].logprob for step, t in zip(ref.logprobs, ref.token_ids)]
        assert all(abs(g - w) < 1e-4 for g, w in zip(lp["token_logprobs"], want))
        for top, step in zip(lp["top_logprobs"], ref.logprobs):
            assert {f"token_id:{t}" for t in step} <= set(top)
    finally:
        stop_server(server)
