"""What a newcomer gets wrong first is refused in one line, before any process starts (#37):
a model path that is not a model directory, a config the model or the machine cannot meet, a
misspelt flag (with the closest one named), and an over-long prompt (refused by the engine,
without transformers' own length warning on top)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.entrypoints.cli import main


@pytest.fixture
def no_process_starts(monkeypatch):
    """Every process pagedserve starts goes through subprocess.Popen: recorded here, never run."""
    started = []

    def refuse(cmd, *a, **kw):
        started.append(cmd)
        raise AssertionError(f"a process was started: {cmd}")
    monkeypatch.setattr(subprocess, "Popen", refuse)
    return started


def serve_error(argv: list[str], capsys) -> str:
    capsys.readouterr()
    try:
        rc = main(["serve", *argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    assert rc == 2, (argv, out)
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err, out
    return out.err


def test_missing_directory_is_named(no_process_starts, capsys):
    err = serve_error(["/no/such/dir"], capsys)
    assert "'/no/such/dir' is not a local directory" in err and "Repo id" not in err
    assert no_process_starts == []


def test_directory_without_a_model_says_what_is_missing(no_process_starts, tmp_path, capsys):
    err = serve_error([str(tmp_path)], capsys)
    assert f"no config.json in '{tmp_path}'" in err
    shutil.copy(DEMO_MODEL_DIR / "config.json", tmp_path / "config.json")
    err = serve_error([str(tmp_path)], capsys)
    assert f"no *.safetensors weights in '{tmp_path}'" in err
    err = serve_error([str(tmp_path), "--load-format", "dummy"], capsys)  # weights not needed: the tokenizer is
    assert f"no tokenizer files" in err and str(tmp_path) in err
    assert no_process_starts == []


def test_max_model_len_beyond_the_model_fails_once_before_the_engine(no_process_starts, capsys):
    err = serve_error(["--max-model-len", "100000"], capsys)
    assert err.count("100000") == 1 and "beyond the model's limit of 1024" in err
    assert no_process_starts == []


@pytest.mark.parametrize("length", [[], ["--max-model-len", "512"]])
def test_a_step_budget_below_max_model_len_without_chunking_fails_before_the_engine(no_process_starts, capsys,
                                                                                    length):
    """Without chunked prefill a prompt runs in one step, so the budget must hold the longest: known
    from the flags (or the model's limit, 1024) without loading anything, so refused before the engine
    process starts, not after it has loaded the model."""
    err = serve_error(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "64", *length], capsys)
    want = length[-1] if length else "1024"
    assert f"max_num_batched_tokens (64) must be >= max_model_len ({want}) when chunked prefill is off" in err
    assert no_process_starts == []


def test_a_negative_long_prefill_token_threshold_is_named(no_process_starts, capsys):
    err = serve_error(["--long-prefill-token-threshold", "-1"], capsys)
    assert "long_prefill_token_threshold must be >= 0 (0: off), got -1" in err
    assert no_process_starts == []


def test_cuda_without_cuda_fails_once_before_the_engine(no_process_starts, capsys, monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    err = serve_error(["--device", "cuda"], capsys)
    assert err.count("CUDA is not available") == 1
    assert no_process_starts == []


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--max_model_len", "64"], "--max_model_len (did you mean --max-model-len?)"),
    (["serve", "--tensor_parallel_size=2"], "--tensor_parallel_size=2 (did you mean --tensor-parallel-size?)"),
    (["bench", "throughput", "--num_requests", "3"], "--num_requests (did you mean --num-requests?)"),
    (["generate", "--max-token", "3", "hi"], None),  # argparse takes the unambiguous prefix itself
])
def test_unknown_flag_names_the_closest_and_the_subcommand_help(argv, expected, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    if expected is None:
        assert "unrecognized" not in err
        return
    assert rc == 2 and len(err.strip().splitlines()) == 1
    command = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    assert expected in err and f"(see pagedserve {command} --help)" in err, err


def test_unknown_flag_without_a_close_one_only_points_to_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--bogus"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus (see pagedserve serve --help)" in err, err


def test_over_long_prompt_is_refused_without_the_tokenizer_warning(capfd):
    from pagedserve import LLM, SamplingParams
    llm = LLM(str(DEMO_MODEL_DIR), device="cpu", max_model_len=64, num_gpu_blocks_override=32)
    prompt = "In the beginning God created the heaven and the earth. " * 200
    capfd.readouterr()
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    out = capfd.readouterr()  # transformers writes its warning straight to the process's stderr
    assert "Token indices sequence length" not in out.err + out.out, out.err
    # The prompt is longer than the tokenizer's own model_max_length (1024), the warning's condition.
    assert len(llm.get_tokenizer()(prompt)["input_ids"]) > 1024


def test_the_dp_routers_tokenizer_prints_no_length_warning_either(capfd):
    """The DP front end tokenizes prompts for its routing keys with the engine's loader, so a
    prompt past the tokenizer's own model_max_length (1024) prints no transformers warning there."""
    from pagedserve.serving.prefix_key import load_tokenizer_path
    tok = load_tokenizer_path(str(DEMO_MODEL_DIR))
    capfd.readouterr()
    ids = tok("In the beginning God created the heaven and the earth. " * 200)["input_ids"]
    out = capfd.readouterr()
    assert len(ids) > 1024
    assert "Token indices sequence length" not in out.err + out.out, out.err


def test_a_chat_template_that_cannot_be_used_fails_in_one_line(no_process_starts, capsys, tmp_path):
    """--chat-template: a missing file, or a template that does not compile, is refused before
    the engine starts, naming the flag's field (not at every chat request)."""
    err = serve_error(["--chat-template", "templates/missing.jinja"], capsys)
    assert "chat_template: 'templates/missing.jinja' looks like a file path" in err
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}\n")
    err = serve_error(["--chat-template", str(broken)], capsys)
    assert "chat_template: not a valid Jinja template: line" in err
    assert no_process_starts == []


def test_a_generation_config_that_cannot_be_read_fails_in_one_line(no_process_starts, capsys, tmp_path):
    err = serve_error(["--generation-config", str(tmp_path)], capsys)
    assert f"generation_config: no generation_config.json in '{tmp_path}'" in err
    err = serve_error(["--override-generation-config", '{"temperature": -1}'], capsys)
    assert "generation_config: its sampling defaults {'temperature': -1} are not valid" in err
    assert no_process_starts == []
