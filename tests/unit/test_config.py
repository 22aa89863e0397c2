"""Config: every ConfigError path names the field, the value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from moriio_ray.config import MoriConfig, PipelineConfig, TransferConfig
from moriio_ray.config_load import load_config, parse_pipeline_config
from moriio_ray.errors import ConfigError

pytestmark = pytest.mark.timeout(30)


def _nest(path: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} from "a.b"."""
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


# (dotted field, bad value, expected message after "field: ")
BAD_VALUES = [
    # transfer
    ("transfer.backend", "tcpx", "'tcpx' is not one of tcp, shm, cuda_ipc, mori"),
    ("transfer.mode", "push", "'push' is not one of read, write"),
    ("transfer.timeout_s", 0, "0.0 must be > 0"),
    ("transfer.kv_lease_s", -1, "-1.0 must be > 0"),
    ("transfer.lease_grace_s", -0.5, "-0.5 must be >= 0.0"),
    ("transfer.read_margin_s", -1, "-1.0 must be >= 0.0"),
    ("transfer.read_margin_s", 30, "30.0 must be below kv_lease_s (30.0)"),
    ("transfer.on_transfer_failure", "retry", "'retry' is not one of recompute, fail"),
    ("transfer.timeout_s", "soon", "Expected `float`, got `str`"),
    # transfer.mori: every knob
    ("transfer.mori.backend", "tcpx", "'tcpx' is not one of rdma, xgmi"),
    ("transfer.mori.qp_per_transfer", 0, "0 must be >= 1"),
    ("transfer.mori.post_batch_size", 0, "0 must be >= 1 or exactly -1"),
    ("transfer.mori.post_batch_size", -2, "-2 must be >= 1 or exactly -1"),
    ("transfer.mori.num_workers", 0, "0 must be >= 1"),
    ("transfer.mori.poll_cq_mode", "spin", "'spin' is not one of polling, event"),
    ("transfer.mori.xgmi_num_streams", 0, "0 must be >= 1"),
    ("transfer.mori.xgmi_num_events", -3, "-3 must be >= 1"),
    ("transfer.mori.enable_notification", "maybe", "Expected `bool`, got `str`"),
    # transfer.tcp and transfer.cuda_ipc
    ("transfer.tcp.port", 70000, "70000 must be in 0..65535"),
    ("transfer.tcp.port", -1, "-1 must be in 0..65535"),
    ("transfer.tcp.connect_timeout_s", 0, "0.0 must be > 0"),
    ("transfer.tcp.staging_bytes", 4096, "4096 must be >= 1048576"),
    ("transfer.tcp.socket_buffer_bytes", 1024, "1024 must be >= 65536"),
    ("transfer.cuda_ipc.small_transfer_bytes", -1, "-1 must be >= 0"),
    ("transfer.cuda_ipc.max_ctas", -1, "-1 must be >= 0"),
    # model and engine
    ("model.preset", "gpt-17", "'gpt-17' is not one of tiny, llama-1b, qwen3-0.6b, llama-8b, sim"),
    ("model.dtype", "int4", "'int4' is not one of auto, float32, bfloat16, float16"),
    ("model.max_model_len", 1, "1 must be >= 2"),
    ("engine.device", "tpu", "'tpu' is not one of auto, cpu, cuda"),
    ("engine.block_size", 0, "0 must be >= 1"),
    ("engine.num_blocks", 0, "0 must be >= 1"),
    ("engine.gpu_memory_fraction", 1.5, "1.5 must be in (0, 1]"),
    ("engine.gpu_memory_fraction", 0, "0.0 must be in (0, 1]"),
    ("engine.layout", "head_major", "'head_major' is not one of layer_major, block_major"),
    ("engine.max_num_seqs", 0, "0 must be >= 1"),
    ("engine.max_num_batched_tokens", 0, "0 must be >= 1"),
    (
        "engine.max_num_batched_tokens",
        32,
        "32 must be >= max_num_seqs (64): every running sequence decodes one token in each step",
    ),
    ("engine.chunked_prefill", "yes", "Expected `bool`, got `str`"),
    ("engine.overlap_scheduling", "on", "Expected `bool | null`, got `str`"),
    # pool, runtime, serve
    (
        "pool.placement_strategy",
        "spreadx",
        "'spreadx' is not one of PACK, SPREAD, STRICT_SPREAD, STRICT_PACK",
    ),
    ("pool.prefill.replicas", -1, "-1 must be >= 0"),
    ("pool.decode.num_gpus", -1, "-1.0 must be >= 0.0"),
    ("pool.decode.num_cpus", -0.5, "-0.5 must be >= 0.0"),
    ("runtime.health_check_period_s", 0, "0.0 must be > 0"),
    ("runtime.remote_timeout_s", -1, "-1.0 must be > 0"),
    ("runtime.prefill_retries", -1, "-1 must be >= 0"),
    ("runtime.worker_start_timeout_s", 0, "0.0 must be > 0"),
    ("serve.max_ongoing_requests", 0, "0 must be >= 1"),
    ("serve.request_timeout_s", 0, "0.0 must be > 0"),
    ("serve.default_max_tokens", 0, "0 must be >= 1"),
    ("serve.num_replicas", 0, "0 must be >= 1"),
    ("serve.stream_interval", 0, "0 must be >= 1"),
    ("name", "a b", "'a b' may hold only letters, digits and _.-/"),
]


@pytest.mark.parametrize(
    ("field", "value", "message"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES]
)
def test_bad_value_names_field_value_and_allowed(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config(_nest(field, value))
    assert str(info.value) == f"{field}: {message}"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"bogus": 1}, "bogus: unknown field; allowed: name, model, engine, transfer, pool, runtime, serve"),
        (
            {"transfer": {"mori": {"qps": 2}}},
            "transfer.mori.qps: unknown field; allowed: backend, qp_per_transfer, post_batch_size, "
            "num_workers, poll_cq_mode, enable_notification, xgmi_num_streams, xgmi_num_events",
        ),
        (
            {"transfer": {"tcp": {"host": "x"}}},
            "transfer.tcp.host: unknown field; allowed: port, bind_host, connect_timeout_s, staging_bytes, "
            "socket_buffer_bytes",
        ),
        (
            {"pool": {"decode": {"gpus": 1}}},
            "pool.decode.gpus: unknown field; allowed: replicas, tensor_parallel_size, num_gpus, "
            "num_cpus, resources, labels",
        ),
    ],
)
def test_unknown_field_lists_the_allowed_ones(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config(data)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (
            {"model": {"preset": "tiny", "path": "/models/x"}},
            r"model.preset/path: set one of model.preset \('tiny'\) and model.path \('/models/x'\), not both",
        ),
        ({"model": {"path": " "}}, "model.path: must not be empty"),
        ({"pool": {"prefill": {"resources": {"acc": -1}}}}, r"pool.prefill.resources.acc: -1.0 must be >= 0"),
        (
            {"pool": {"prefill": {"labels": {"bad key!": "x"}}}},
            "pool.prefill.labels: 'bad key!' is not a valid",
        ),
        ({"pool": {"colocated": {"replicas": 1}}}, "colocated.replicas: a pool is either colocated or"),
        ({"pool": {"decode": {"replicas": 0}}}, r"prefill.replicas/decode.replicas: .*\(got 1 and 0\)"),
    ],
)
def test_combination_errors(data: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        parse_pipeline_config(data)


def test_a_model_path_wins_without_preset_null() -> None:
    """``preset`` defaults to tiny only when no path is given, so ``model: {path: ...}`` is enough."""
    assert parse_pipeline_config({}).model.preset == "tiny"
    assert parse_pipeline_config({"model": {"preset": None}}).model.preset == "tiny"
    for path, name in [
        ("/models/x", "x"),
        ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
    ]:
        model = parse_pipeline_config({"model": {"path": path}}).model
        assert model.preset is None and model.path == path and model.name == name


def test_root_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="<root>: expected a mapping, got list"):
        parse_pipeline_config([1, 2])
    assert parse_pipeline_config(None) == PipelineConfig()


def test_enums_are_case_insensitive_and_normalised() -> None:
    cfg = parse_pipeline_config(
        {
            "transfer": {
                "backend": "TCP",
                "mode": "Write",
                "mori": {"backend": "XGMI", "poll_cq_mode": "Event"},
            },
            "pool": {"placement_strategy": "strict_spread"},
        }
    )
    assert cfg.transfer.backend == "tcp"
    assert cfg.transfer.mode == "write"
    assert cfg.transfer.mori.backend == "xgmi"
    assert cfg.transfer.mori.poll_cq_mode == "event"
    assert cfg.pool.placement_strategy == "STRICT_SPREAD"
    # the direct constructors normalise too
    assert TransferConfig(backend="Shm").backend == "shm"
    assert MoriConfig(backend="RDMA").backend == "rdma"


def test_special_values_that_are_allowed() -> None:
    cfg = parse_pipeline_config(
        {"transfer": {"mori": {"post_batch_size": -1}, "tcp": {"port": 0}, "read_margin_s": 0}}
    )
    assert cfg.transfer.mori.post_batch_size == -1
    assert cfg.transfer.tcp.port == 0
    colocated = parse_pipeline_config(
        {"pool": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": {"replicas": 2}}}
    )
    assert colocated.mode == "colocated"


# -- load_config -----------------------------------------------------------------------------------

SERVE_FILE = """\
applications:
  - name: other
    import_path: somewhere:app
  - name: pd
    route_prefix: /
    import_path: serve_apps.pd_openai:app
    args:
      name: tiny
      transfer:
        backend: TCP
        timeout_s: 3
"""

BARE_FILE = """\
transfer:
  backend: shm
  mori:
    backend: Xgmi
engine:
  block_size: 32
"""


def test_load_config_reads_a_serve_file(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(SERVE_FILE)
    cfg = load_config(path)
    assert (cfg.name, cfg.transfer.backend, cfg.transfer.timeout_s) == ("tiny", "tcp", 3.0)
    assert load_config(path, app_name="pd") == cfg
    with pytest.raises(ConfigError, match="applications: no application 'missing'; have other, pd"):
        load_config(path, app_name="missing")
    assert load_config(path, app_name="other") == PipelineConfig()  # an app without args


def test_load_config_reads_a_bare_file(tmp_path: Path) -> None:
    path = tmp_path / "bare.yaml"
    path.write_text(BARE_FILE)
    cfg = load_config(str(path))
    assert (cfg.transfer.backend, cfg.transfer.mori.backend, cfg.engine.block_size) == ("shm", "xgmi", 32)


def test_load_config_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"<file>: {tmp_path / 'nope.yaml'} does not exist")):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("transfer: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(broken)
    empty_apps = tmp_path / "empty.yaml"
    empty_apps.write_text("applications: []\n")
    with pytest.raises(ConfigError, match="has no applications"):
        load_config(empty_apps)
    bad_args = tmp_path / "args.yaml"
    bad_args.write_text("applications:\n  - name: pd\n    args: [1, 2]\n")
    with pytest.raises(ConfigError, match="args: expected a mapping, got list"):
        load_config(bad_args)
    bad_value = tmp_path / "value.yaml"
    bad_value.write_text("applications:\n  - name: pd\n    args:\n      transfer:\n        mode: push\n")
    with pytest.raises(ConfigError, match=r"transfer\.mode: 'push' is not one of read, write"):
        load_config(bad_value)
