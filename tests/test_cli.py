"""The CLI explains itself: every flag has help with its default and choices (engine flags from
EngineConfig's field docs), `--version`, and user mistakes are one line on stderr, exit 2."""
from __future__ import annotations

import argparse
import dataclasses
import shutil

import pytest

from pagedserve import __version__
from pagedserve.config import EngineConfig
from pagedserve.engine_args import engine_fields
from pagedserve.entrypoints.cli import build_parser, main


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", s) for n, s in _subparsers(sub))


COMMANDS = dict(_subparsers(build_parser()))


def test_every_engine_field_is_documented():
    """A new EngineConfig field without help fails here, not silently in --help."""
    for f, _ in engine_fields():
        assert len(f.metadata.get("help", "")) > 10, f.name
    documented = {f.name for f, _ in engine_fields()}
    assert documented == {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "extra"}


@pytest.mark.parametrize("command", ["serve", "generate", "bench throughput", "bench serve", "sim"])
def test_every_flag_has_help_default_and_choices(command):
    parser = COMMANDS[command]
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
        if action.choices:
            assert "{" + ",".join(map(str, action.choices)) + "}" in text
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            shown = parser._get_formatter()._expand_help(action)  # the line --help prints
            assert shown in " ".join(text.split()) or shown.split()[-1] in text
            assert f"(default: {action.default})" in shown, (command, action.option_strings, shown)


def test_engine_flags_come_from_the_config_fields():
    serve = COMMANDS["serve"]
    by_dest = {a.dest: a for a in serve._actions}
    for f, _ in engine_fields():
        action = by_dest[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert action.default == f.default and action.help.startswith(f.metadata["help"])
        assert tuple(action.choices or ()) == tuple(f.metadata.get("choices", ()))


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pagedserve {__version__}"


def _one_line_error(argv: list[str], capsys) -> str:
    capsys.readouterr()  # drop what set-up printed
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, (argv, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, words", [
    (["serve", "--port", "80000"], ["--port", "65535", "80000"]),
    (["serve", "--port", "http"], ["--port", "'http'"]),
    (["sim", "--block-size", "0"], ["block_size", "[1, 1024]"]),
    (["sim", "--workload", "nope"], ["--workload", "invalid choice"]),
    (["sim", "--request-rate", "-1"], ["--request-rate", "> 0"]),
    (["serve", "--kv-allocator", "buddy"], ["--kv-allocator", "contiguous-max"]),
    (["bench", "throughput", "--repeats", "0"], ["--repeats", ">= 1"]),
])
def test_bad_flags_are_one_line(argv, words, capsys):
    err = _one_line_error(argv, capsys)
    for w in words:
        assert w in err, (w, err)


def test_truncated_config_json_is_one_line(tiny_model_dir, tmp_path, capsys):
    src = tiny_model_dir("llama")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    text = (src / "config.json").read_text()
    (tmp_path / "config.json").write_text(text[: len(text) // 2])
    err = _one_line_error(["generate", "--model", str(tmp_path), "--device", "cpu", "hi"], capsys)
    assert "config.json is not valid JSON" in err and "line" in err


def test_missing_weights_suggest_the_flag(tiny_model_dir, tmp_path, capsys):
    src = tiny_model_dir("llama")
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    err = _one_line_error(["generate", "--model", str(tmp_path), "--device", "cpu", "hi"], capsys)
    assert "no *.safetensors" in err and "--load-format dummy" in err


def test_llm_signature_defaults_are_the_config_defaults():
    """LLM(...) spells its arguments out for editors; they must not drift from EngineConfig."""
    import inspect

    from pagedserve import LLM
    params = inspect.signature(LLM.__init__).parameters
    for f, _ in engine_fields():
        if f.name in params:
            assert params[f.name].default == f.default, f.name


def test_taken_port_is_one_line_before_loading(tiny_model_dir, capsys):
    import socket
    model = str(tiny_model_dir("llama"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _one_line_error(["serve", model, "--port", str(port), "--device", "cpu"], capsys)
    assert f"cannot listen on 127.0.0.1:{port}" in err


@pytest.mark.parametrize("text,value", [("131072", 131072), ("128K", 131072), ("32k", 32000), ("25.6k", 25600),
                                        ("16.1k", 16100), ("8.2m", 8_200_000), ("1M", 2**20), ("2m", 2_000_000),
                                        (" 4096 ", 4096)])
def test_token_counts_take_human_readable_integers(text, value):
    """vLLM's --max-model-len 128K / 32k: upper case binary, lower case decimal."""
    from pagedserve.engine_args import engine_config_from_args
    args = COMMANDS["serve"].parse_args(["--max-model-len", text, "--max-num-batched-tokens", text])
    cfg = engine_config_from_args(args, model=None)
    assert cfg.max_model_len == value and cfg.max_num_batched_tokens == value


@pytest.mark.parametrize("text,words", [("12x", "invalid integer '12x'"), ("1.5K", "invalid integer '1.5K'"),
                                        ("1.0001k", "not a whole number"), ("infk", "not a whole number")])
def test_bad_token_counts_are_one_line(text, words, capsys):
    err = _one_line_error(["serve", "--max-model-len", text], capsys)
    assert "--max-model-len" in err and words in err, err


@pytest.mark.parametrize("text", ["auto", "AUTO", "-1"])
def test_max_model_len_auto(text):
    from pagedserve.config import MAX_MODEL_LEN_AUTO
    from pagedserve.engine_args import engine_config_from_args
    args = COMMANDS["serve"].parse_args(["--max-model-len", text])
    assert engine_config_from_args(args, model=None).max_model_len == MAX_MODEL_LEN_AUTO
    if text != "-1":
        with pytest.raises(SystemExit):  # auto is max_model_len's alone
            COMMANDS["serve"].parse_args(["--max-num-batched-tokens", text])
