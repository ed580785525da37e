"""`pagedserve generate` end to end on a tiny model."""
from pagedserve.entrypoints.cli import main

from .helpers import hf_greedy, tokenizer


def test_generate_cli_prints_greedy_completions(tiny_model_dir, capsys):
    model_dir = tiny_model_dir("llama")
    prompts = ["The quick brown fox", "Привет, мир!"]
    rc = main(["generate", "--model", str(model_dir), "--max-tokens", "5", "--device", "cpu",
               "--num-gpu-blocks-override", "64", "--swap-space", "0", *prompts])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    tok = tokenizer(str(model_dir))
    for prompt, line in zip(prompts, lines):
        want = tok.decode(hf_greedy(model_dir, tok.encode(prompt), 5), skip_special_tokens=True)
        assert line.startswith(repr(prompt)) and repr(want) in line


def test_generate_cli_bad_argument_is_a_clean_error(tiny_model_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir("llama")), "--max-tokens", "0", "hi"])
    assert rc == 2
    assert "max_tokens" in capsys.readouterr().err
