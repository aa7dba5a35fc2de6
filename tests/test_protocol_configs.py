"""StageConfig / Topology validation (spec §9.1, §9.2) and plan_layer_split."""

from __future__ import annotations

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy.protocol import (
    PeerEndpoint, StageConfig, Topology, parse_endpoint, plan_layer_split,
)


def _stage(index: int, start: int, end: int, endpoint: str | None = None) -> dict:
    return {"stage_id": f"s{index}", "stage_index": index, "layer_start": start,
            "layer_end": end, "endpoint": endpoint or f"10.0.0.{index + 1}:9000"}


def _topology(*stages: dict) -> dict:
    return {"topology_id": "t1", "model_id": "smollm2", "stages": list(stages)}


def test_valid_topology():
    topo = Topology.model_validate(
        _topology(_stage(0, 0, 10), _stage(1, 10, 20), _stage(2, 20, 30)))
    assert topo.num_layers == 30
    assert topo.driver_endpoint == "10.0.0.1:9000"
    assert topo.stages[1].layer_start == 10


TOPOLOGY_ERRORS = [
    # (stages, message fragment)
    ([_stage(0, 0, 12), _stage(1, 10, 20)], "overlaps"),                  # overlapping ranges
    ([_stage(0, 0, 10), _stage(1, 12, 20)], "belong to no stage"),        # gap between stages
    ([_stage(0, 2, 10)], "belong to no stage"),                           # does not start at 0
    ([_stage(0, 0, 10), _stage(1, 10, 10)], "layer_end > layer_start"),   # empty range
    ([_stage(1, 0, 10), _stage(0, 10, 20)], "stage_index"),               # indices out of order
    ([_stage(0, 0, 10), _stage(2, 10, 20)], "stage_index"),               # index skipped
    ([_stage(0, 0, 10), {**_stage(1, 10, 20), "stage_id": "s0"}], "duplicate"),
    ([_stage(0, 0, 10, "localhost")], "host:port"),                       # no port
    ([_stage(0, 0, 10, "host:http")], "numeric port"),                    # port not a number
    ([_stage(0, 0, 10, "host:70000")], "port"),                           # port out of range
    ([_stage(0, 0, 10, "host:0")], "port"),                               # port 0 is bind-only
    ([_stage(0, 0, 10, ":9000")], "host:port"),                           # no host
    ([_stage(0, 0, 10, "::1:9000")], "brackets"),                         # bare IPv6
    ([], "at least 1"),                                                   # no stages at all
]


@pytest.mark.parametrize("stages, fragment", TOPOLOGY_ERRORS)
def test_topology_errors(stages, fragment):
    with pytest.raises(pydantic.ValidationError, match=fragment):
        Topology.model_validate(_topology(*stages))


def test_topology_rejects_unknown_keys():
    with pytest.raises(pydantic.ValidationError, match="extra"):
        Topology.model_validate({**_topology(_stage(0, 0, 4)), "stagez": []})


def test_topology_load_save(tmp_path):
    topo = Topology.model_validate(_topology(_stage(0, 0, 15), _stage(1, 15, 30, "[::1]:7001")))
    path = tmp_path / "topology.json"
    topo.save(path)
    assert Topology.load(path) == topo
    path.write_text('{"topology_id": "t", "model_id": "m", "stages": [{"stage_id": "a"}]}')
    with pytest.raises(pydantic.ValidationError):
        Topology.load(path)


ENDPOINTS = [
    # (text, parsed)
    ("127.0.0.1:9000", ("127.0.0.1", 9000)),
    ("stage-1.local:1", ("stage-1.local", 1)),
    ("[::1]:65535", ("::1", 65535)),
]


@pytest.mark.parametrize("text, parsed", ENDPOINTS)
def test_parse_endpoint(text, parsed):
    assert parse_endpoint(text) == parsed


def _stage_config(**overrides) -> dict:
    return {"stage_id": "s1", "stage_index": 1, "layer_start": 10, "layer_end": 20,
            "model_path": "/models/m.gguf", **overrides}


def test_stage_config_defaults():
    config = StageConfig.model_validate(_stage_config())
    assert (config.ctx_size, config.lane_count, config.max_inflight) == (2048, 4, 4)
    assert (config.bind_host, config.bind_port) == ("127.0.0.1", 0)
    assert config.activation_dtype == "f32" and config.device == "auto"
    assert config.max_deferred_replies == 3  # max_inflight - 1
    assert config.kv_cache.max_entries == 64 and config.kv_cache.min_tokens == 64
    assert config.kv_cache.stride_tokens == 128
    assert config.downstream is None and config.stage_index != 0


def test_stage_config_peers_and_token(tmp_path):
    config = StageConfig.model_validate(_stage_config(
        upstream={"stage_id": "s0", "stage_index": 0, "endpoint": "10.0.0.1:9000"},
        downstream={"stage_id": "s2", "stage_index": 2, "endpoint": "10.0.0.3:9000"},
        auth_token="hunter2", reply_credit_limit=0, activation_dtype="bf16"))
    assert config.downstream == PeerEndpoint(stage_id="s2", stage_index=2, endpoint="10.0.0.3:9000")
    assert config.downstream.endpoints == ["10.0.0.3:9000"]
    assert config.max_deferred_replies == 0
    assert "hunter2" not in repr(config)
    path = tmp_path / "stage.json"
    config.save(path)
    assert StageConfig.load(path) == config


STAGE_CONFIG_ERRORS = [
    # (overrides, message fragment)
    ({"layer_end": 10}, "layer_end > layer_start"),                      # empty range
    ({"stage_index": -1}, "stage_index"),
    ({"bind_addr": "127.0.0.1"}, "host:port"),                           # no port
    ({"upstream": {"stage_id": "s0", "stage_index": 3, "endpoint": "h:1"}}, "upstream"),
    ({"downstream": {"stage_id": "s2", "stage_index": 1, "endpoint": "h:1"}}, "downstream"),
    ({"downstream": {"stage_id": "s2", "stage_index": 2, "endpoint": "h"}}, "host:port"),
    ({"auth_token": ""}, "auth token"),                                  # 0 bytes
    ({"auth_token": "x" * 65}, "auth token"),                            # over 64 bytes
    ({"activation_dtype": "q4"}, "activation_dtype"),
    ({"max_inflight": 0}, "max_inflight"),
    ({"kv_cache": {"mode": "sometimes"}}, "mode"),
    ({"lane_cuont": 2}, "extra"),                                        # typo is not ignored
]


@pytest.mark.parametrize("overrides, fragment", STAGE_CONFIG_ERRORS)
def test_stage_config_errors(overrides, fragment):
    with pytest.raises(pydantic.ValidationError, match=fragment):
        StageConfig.model_validate(_stage_config(**overrides))


def test_configs_are_frozen():
    config = StageConfig.model_validate(_stage_config())
    with pytest.raises(pydantic.ValidationError):
        config.ctx_size = 1


# ---------------------------------------------------------------------------
# plan_layer_split
# ---------------------------------------------------------------------------
SPLITS = [
    # (n_layers, n_stages, weights, expected)
    (30, 1, None, [(0, 30)]),                                   # one stage takes all
    (30, 3, None, [(0, 10), (10, 20), (20, 30)]),               # even
    (10, 3, None, [(0, 4), (4, 7), (7, 10)]),                   # remainder to the first stages
    (5, 5, None, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),     # one layer each
    (30, 3, [1, 2, 3], [(0, 5), (5, 15), (15, 30)]),            # proportional
    (24, 2, [3, 1], [(0, 18), (18, 24)]),                       # 3:1
    (10, 3, [100, 1, 1], [(0, 8), (8, 9), (9, 10)]),            # tiny weights still get 1 layer
    (7, 2, [1, 1e-9], [(0, 6), (6, 7)]),
]


@pytest.mark.parametrize("n_layers, n_stages, weights, expected", SPLITS)
def test_plan_layer_split(n_layers, n_stages, weights, expected):
    assert plan_layer_split(n_layers, n_stages, weights) == expected


HEAD_SPLITS = [
    # (n_layers, n_stages, weights, head_layers, expected)
    (30, 2, None, 8.0, [(0, 19), (19, 30)]),                    # SmolLM2: 19 | 11 + head
    (30, 3, None, 8.0, [(0, 13), (13, 26), (26, 30)]),
    (30, 2, [3, 1], 2.0, [(0, 24), (24, 30)]),                  # 32 shared 3:1, the head in stage 1's 8
    (4, 2, None, 50.0, [(0, 3), (3, 4)]),                       # a huge head still leaves 1 layer
    (30, 1, None, 8.0, [(0, 30)]),
]


@pytest.mark.parametrize("n_layers, n_stages, weights, head_layers, expected", HEAD_SPLITS)
def test_plan_layer_split_counts_the_head_on_the_last_stage(n_layers, n_stages, weights, head_layers,
                                                              expected):
    assert plan_layer_split(n_layers, n_stages, weights, head_layers) == expected


def test_plan_chain_balances_the_bundled_model_with_its_head(gguf_path):
    from skippy.launch.local_chain import plan_chain
    from skippy.model.loader import model_args

    assert model_args(gguf_path).head_cost_in_layers == 8.0  # 49152 x 576 over 3,538,944: exact in float64
    topology, configs = plan_chain(gguf_path, ["127.0.0.1:1", "127.0.0.1:2"])
    assert [(s.layer_start, s.layer_end) for s in topology.stages] == [(0, 19), (19, 30)]
    assert all(c.repack_weights for c in configs)


SPLIT_ERRORS = [
    (3, 4, None),            # fewer layers than stages
    (10, 0, None),           # no stages
    (10, 2, [1]),            # weight count mismatch
    (10, 2, [1, 0]),         # zero weight
    (10, 2, [1, float("nan")]),
    (10, 2, None, -1.0),     # negative head
    (10, 2, None, float("inf")),
]


@pytest.mark.parametrize("arguments", SPLIT_ERRORS)
def test_plan_layer_split_errors(arguments):
    with pytest.raises(ValueError):
        plan_layer_split(*arguments)


@st.composite
def split_inputs(draw):
    n_stages = draw(st.integers(1, 12))
    n_layers = draw(st.integers(n_stages, 200))
    weights = draw(st.none() | st.lists(st.floats(0.01, 100.0), min_size=n_stages,
                                        max_size=n_stages))
    head_layers = draw(st.sampled_from([0.0, 0.0, 1.5, 8.0, 40.0]))
    return n_layers, n_stages, weights, head_layers


@given(split_inputs())
def test_split_is_contiguous_and_covers_every_layer(args):
    n_layers, n_stages, weights, head_layers = args
    ranges = plan_layer_split(n_layers, n_stages, weights, head_layers)
    assert len(ranges) == n_stages
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(end - start >= 1 for start, end in ranges)
    # The result is a valid topology.
    Topology.model_validate(_topology(*(_stage(i, s, e) for i, (s, e) in enumerate(ranges))))
    sizes = [end - start for start, end in ranges]
    if weights is None and head_layers == 0:
        assert max(sizes) - min(sizes) <= 1
    else:
        weights = weights or [1.0] * n_stages
        ideal = [(n_layers + head_layers) * w / sum(weights) for w in weights]
        ideal[-1] -= head_layers
        if min(ideal) >= 1:  # no stage was lifted to its 1-layer minimum
            assert all(abs(size - share) < 1 for size, share in zip(sizes, ideal))


def test_skippy_stage_command_line_overrides_its_config(gguf_path, tmp_path):
    from skippy.cli import build_parser, stage_config
    from skippy.launch.local_chain import plan_chain, write_plan

    _, config_path, _ = write_plan(*plan_chain(gguf_path, ["127.0.0.1:1", "127.0.0.1:2"]), tmp_path)
    parse = build_parser().parse_args
    plain = stage_config(parse(["stage", "--config", str(config_path)]))
    assert plain.repack_weights and plain.max_inflight == 4
    changed = stage_config(parse(["stage", "--config", str(config_path), "--no-repack", "--max-inflight", "2"]))
    assert not changed.repack_weights and changed.max_inflight == 2
    assert changed.model_copy(update={"repack_weights": True, "max_inflight": 4}) == plain
