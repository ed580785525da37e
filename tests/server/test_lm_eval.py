"""lm-evaluation-harness (`lm-eval`, its `local-completions` model) against `pagedserve serve` on the
demo model: one loglikelihood task (multiple choice) and one generation task, over tiny datasets
written here. lm-eval's loglikelihoods are checked against HF over the very tokens lm-eval sends,
its generations against HF greedy decoding, so the test shows the server answers the harness's
echo + logprobs and generate calls correctly, not merely that a score comes out."""
import json
import os

import pytest
import torch

from pagedserve.demo_model import DEMO_MODEL_DIR

lm_eval = pytest.importorskip("lm_eval")  # a dev dependency (pyproject.toml)

MC = [  # KJV verses the demo model was trained on: the right continuation is far likelier
    {"question": "In the beginning God created the", "choices": [" heaven and the earth.", " ships of the sea."],
     "answer": 0},
    {"question": "And God said, Let there be", "choices": [" iron:", " light:"], "answer": 1},
    {"question": "The LORD is my shepherd; I shall not", "choices": [" want.", " sleep."], "answer": 0},
]
GEN = [{"prompt": "In the beginning God", "target": " created the heaven and the earth."},
       {"prompt": "And the earth was without form,", "target": " and void"}]
MAX_GEN = 8


def _task_dir(tmp_path):
    for name, rows in (("mc", MC), ("gen", GEN)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ntest_split: test\n"
    (tmp_path / "demo_mc.yaml").write_text(
        "task: pagedserve_demo_mc\n" + common +
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (tmp_path / "demo_gen.yaml").write_text(
        "task: pagedserve_demo_gen\n" + common +
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        f"generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return tmp_path


@pytest.fixture(scope="module")
def demo_server(tools_server):
    """The session's demo-model server (conftest.tools_server), not one of its own: its tool-call
    and reasoning parsers and its chat template act on chat completions only, and lm-eval's
    local-completions model calls /v1/completions."""
    return tools_server


def test_lm_eval_local_completions_scores_match_hf(demo_server, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = (f"model={demo_server.model},base_url={demo_server.v1}/completions,tokenizer={DEMO_MODEL_DIR},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=512")
    out = simple_evaluate(model="local-completions", model_args=args,
                          tasks=["pagedserve_demo_mc", "pagedserve_demo_gen"],
                          task_manager=TaskManager(include_path=str(_task_dir(tmp_path))), log_samples=True)
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    from lm_eval.api.registry import get_model
    lm = get_model("local-completions")(model=demo_server.model, base_url=f"{demo_server.v1}/completions",
                                        tokenizer=str(DEMO_MODEL_DIR), tokenizer_backend="huggingface")
    correct = []
    for sample in out["samples"]["pagedserve_demo_mc"]:
        wants = []
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx, cont = lm._encode_pair(context, continuation)  # the tokens lm-eval sent
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            want = sum(logp[len(ctx) + j - 1, t].item() for j, t in enumerate(cont))
            assert abs(float(resp[0][0]) - want) < 1e-3, (context, continuation, resp, want)
            # is_greedy: every continuation token is HF's argmax there
            greedy = all(logp[len(ctx) + j - 1].argmax().item() == t for j, t in enumerate(cont))
            assert resp[0][1] == greedy or resp[0][1] in (str(greedy), "True" if greedy else "False")
            wants.append(want)
        correct.append(max(range(len(wants)), key=wants.__getitem__) == sample["target"])
    assert out["results"]["pagedserve_demo_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    assert sum(correct) >= 2  # and the demo model knows its KJV: the verse beats the decoy

    for sample in out["samples"]["pagedserve_demo_gen"]:
        ids = lm.tok_encode(sample["arguments"][0][0])
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_GEN, do_sample=False, pad_token_id=tok.pad_token_id)
        want = tok.decode(gen[0, len(ids):], skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == want, (sample["resps"], want)
