"""Bad data-parallel flags fail with one line naming the field, before any replica starts."""
from __future__ import annotations

import pytest

from pagedserve.entrypoints.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-size", "0"], "data_parallel_size must be >= 1, got 0"),
    (["--data-parallel-size", "2", "--routing-imbalance-threshold", "-1"],
     "routing_imbalance_threshold must be >= 0"),
    (["--data-parallel-size", "2", "--min-replicas", "1", "--max-replicas", "2"],
     "need --data-parallel-backend ray"),
    (["--data-parallel-backend", "ray", "--min-replicas", "3", "--max-replicas", "2"],
     "need 1 <= min_replicas <= max_replicas, got 3 and 2"),
    (["--data-parallel-backend", "ray", "--min-replicas", "3"], "min_replicas and max_replicas go together"),
    (["--data-parallel-backend", "ray", "--ray-autoscaling-config", "{}"],
     "ray_autoscaling_config needs --min-replicas and --max-replicas"),
    (["--data-parallel-backend", "ray", "--min-replicas", "1", "--max-replicas", "2",
      "--ray-autoscaling-config", "{oops"], "ray_autoscaling_config: not JSON"),
    (["--data-parallel-backend", "ray", "--min-replicas", "1", "--max-replicas", "2",
      "--ray-autoscaling-config", "[1]"], "ray_autoscaling_config: must be a JSON object"),
    (["--data-parallel-backend", "ray", "--min-replicas", "1", "--max-replicas", "2",
      "--ray-autoscaling-config", '{"max_replicas": 4}'],
     "ray_autoscaling_config: set max_replicas with --max-replicas"),
    (["--data-parallel-size", "2", "--api-server-count", "0"], "api_server_count must be >= 1, got 0"),
    (["--data-parallel-backend", "ray", "--api-server-count", "2"],
     "api_server_count > 1 is for --data-parallel-backend mp"),
    (["--api-server-count", "2"], "api_server_count > 1 needs --data-parallel-size > 1"),
    (["--enable-log-requests", "--disable-log-requests"],
     "--enable-log-requests and --disable-log-requests contradict each other"),
    (["--data-parallel-backend", "ray", "--data-parallel-size", "2", "--return-tokens-as-token-ids"],
     "--return-tokens-as-token-ids is not supported with --data-parallel-backend ray yet"),
    (["--data-parallel-backend", "ray", "--data-parallel-size", "2", "--allowed-origins", '["*"]'],
     "--allowed-origins is not supported with --data-parallel-backend ray yet"),
])
def test_bad_dp_flags(flags, message, capsys):
    assert main(["serve", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_unknown_routing_policy_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--data-parallel-size", "2", "--routing-policy", "random"])
    assert "--routing-policy: invalid choice: 'random'" in capsys.readouterr().err.splitlines()[-1]


def test_more_gpus_than_visible_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    # A machine without CUDA is refused first, by serve's preflight (tests/test_newcomer_errors.py);
    # here two GPUs are pretended, for the launcher's own arithmetic.
    monkeypatch.setattr("pagedserve.engine.preflight.check_device", lambda device: None)
    rc = main(["serve", "--device", "cuda", "--data-parallel-size", "2", "--tensor-parallel-size", "2"])
    assert rc == 2
    assert "data_parallel_size x tensor_parallel_size = 2 x 2 needs 4 GPUs, only 2 visible" \
        in capsys.readouterr().err


def test_replica_flags_rebuild_the_config():
    """A replica is started with engine_flags(config); parsed back they must give the same config
    (lists one argument per value, bools as --x / --no-x, objects as JSON: a Python repr there
    once kept every replica of `--hf-overrides` or `--speculative-config` from starting)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.serving.launch import engine_flags
    config = EngineConfig(model="m", cuda_graph_sizes=[1, 8, 24], enable_prefix_caching=False,
                          max_num_seqs=48, gpu_memory_utilization=0.5, cudagraph_mode="decode",
                          hf_overrides={"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    args = build_parser().parse_args(["serve", "--model", "m", *engine_flags(config)])
    assert engine_config_from_args(args, "m") == config


def test_serve_flags_reach_every_mp_replica():
    """The replica-side `serve` flags of the front end's command line (launch._server_flags)."""
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.serving.launch import _server_flags
    args = build_parser().parse_args(["serve", "--enable-log-requests", "--disable-log-stats",
                                      "--return-tokens-as-token-ids", "--uvicorn-log-level", "warning"])
    flags = _server_flags(args)
    replica = build_parser().parse_args(["serve", *flags])
    assert (replica.enable_log_requests, replica.disable_log_stats, replica.return_tokens_as_token_ids,
            replica.uvicorn_log_level) == (True, True, True, "warning")
    plain = build_parser().parse_args(["serve", *_server_flags(build_parser().parse_args(["serve"]))])
    assert (plain.enable_log_requests, plain.disable_log_stats, plain.return_tokens_as_token_ids) == (False,) * 3
