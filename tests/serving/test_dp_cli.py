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
    rc = main(["serve", "--device", "cuda", "--data-parallel-size", "2", "--tensor-parallel-size", "2"])
    assert rc == 2
    assert "data_parallel_size x tensor_parallel_size = 2 x 2 needs 4 GPUs, only 2 visible" \
        in capsys.readouterr().err
