"""The bundled demo model: it is a real HF Llama directory, small, trained, and chat-ready."""
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pagedserve.demo_model import DEMO_MODEL_DIR, demo_eval_record

MAX_SAFETENSORS_BYTES = 8_000_000


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    m = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    return m.eval()


def test_demo_dir_is_a_complete_hf_directory_inside_the_package():
    import pagedserve
    assert DEMO_MODEL_DIR.parent.resolve() == Path(pagedserve.__file__).parent.resolve()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md", "eval.json", "heldout.txt"):
        assert (DEMO_MODEL_DIR / name).is_file(), name


def test_safetensors_total_size_within_budget():
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.glob("*.safetensors"))
    assert 0 < total <= MAX_SAFETENSORS_BYTES


def test_loads_in_hf_as_llama(tok, model):
    cfg = AutoConfig.from_pretrained(DEMO_MODEL_DIR)
    assert cfg.model_type == "llama" and type(model).__name__ == "LlamaForCausalLM"
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 2_000_000
    assert len(tok) <= cfg.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    ids = tok("In the beginning", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()


def test_tokenizer_round_trips_text(tok):
    text = (DEMO_MODEL_DIR / "heldout.txt").read_text()[:3000] + " Héllo wörld 🚀 日本語"
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text


def heldout_perplexity(model, tok, text: str, window: int) -> tuple[float, int]:
    """The procedure written in eval.json: chapters as <s> chapter </s>, back to back, scored in
    non-overlapping windows where every token but the window's first is predicted."""
    ids = []
    for chapter in text.strip("\n").split("\n\n"):
        ids += tok(chapter).input_ids + [tok.eos_token_id]
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[i:i + window]])
            if chunk.shape[1] < 2:
                continue
            logits = model(chunk).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return math.exp(nll / count), count


def test_heldout_perplexity_below_recorded_bound(tok, model):
    rec = demo_eval_record()
    spec = rec["heldout"]
    text = (DEMO_MODEL_DIR / spec["file"]).read_text()
    ppl, count = heldout_perplexity(model, tok, text, spec["window"])
    assert count == spec["tokens"]
    assert ppl <= rec["bound"], (ppl, rec)
    # The bound itself must describe a trained model: far below a uniform guess over the vocabulary.
    assert rec["bound"] < len(tok) / 20


def greedy(model, tok, ids: torch.Tensor, n: int) -> torch.Tensor:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:]


@pytest.mark.parametrize("prompt", ["In the beginning", "And the LORD said unto Moses,"])
def test_greedy_generation_is_not_degenerate(tok, model, prompt):
    new = greedy(model, tok, tok(prompt, return_tensors="pt").input_ids, 48)
    text = tok.decode(new, skip_special_tokens=True)
    tokens = new.tolist()
    # A 2M-parameter model's greedy text loops over phrases ("and the LORD thy God, and ..."):
    # that is fine. A broken one repeats a token or byte, or emits byte soup.
    assert len(set(tokens)) >= 8, text
    longest_run = max(len(list(g)) for _, g in itertools.groupby(tokens))
    assert longest_run < 4, text
    words = [w.strip(".,;:!?'()") for w in text.split()]
    words = [w for w in words if w]
    assert len(words) >= 15, text
    assert sum(w.isalpha() for w in words) >= 0.9 * len(words), text
    # Words of English as this text spells it: most generated words occur in the held-out chapters.
    known = {w.strip(".,;:!?'()").lower() for w in (DEMO_MODEL_DIR / "heldout.txt").read_text().split()}
    assert sum(w.lower() in known for w in words) >= 0.7 * len(words), text


def test_chat_template_renders_roles_and_generation_prompt(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Peace be unto you."}, {"role": "user", "content": "Again"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text.startswith(tok.bos_token)
    pos = [text.index(f"<|{m['role']}|>\n{m['content']}{tok.eos_token}") for m in msgs]
    assert pos == sorted(pos)
    assert not text.endswith("<|assistant|>\n")
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == text + "<|assistant|>\n"
    ids = tok(prompt, add_special_tokens=False).input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    for marker in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert tok.convert_tokens_to_ids(marker) in ids
    with pytest.raises(Exception, match="role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_chat_reply_ends_with_eos(tok, model):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Continue: The LORD is my shepherd"}],
                                     tokenize=False, add_generation_prompt=True)
    new = greedy(model, tok, tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids, 64)
    assert tok.eos_token_id in new.tolist(), tok.decode(new)
    reply = tok.decode(new, skip_special_tokens=True).strip()
    assert len(reply.split()) >= 3, reply


def test_eval_record_is_consistent():
    rec = demo_eval_record()
    assert rec["bound"] == pytest.approx(rec["heldout_perplexity"] * 1.05, rel=1e-3)
    assert json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())["eos_token_id"] == 1


def test_pagedserve_greedy_equals_hf_on_the_demo_model(tok, model):
    """The shipped model through pagedserve's own loader, paged cache and sampler: HF's greedy tokens."""
    from pagedserve import LLM, SamplingParams

    prompts = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the"]
    llm = LLM(str(DEMO_MODEL_DIR), device="cpu", dtype="float32", num_gpu_blocks_override=256, swap_space=0.01)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24,
                                 attention_mask=torch.ones_like(ids), pad_token_id=tok.pad_token_id)
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
