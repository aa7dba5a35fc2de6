"""`skippy serve --ray`'s decisions without a cluster: the bundles and the split, the security
check, the CLI's options, and the supervisor over a placement whose stage moves or keeps dying
(the cluster itself: tests/test_ray_chain.py)."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from skippy.cli import build_parser, ray_settings, serve_config
from skippy.launch.ray_chain import RayChain, RaySettings, check_cluster_security, split_weights
from skippy.model.locate import bundled_model_path
from skippy.launch.supervisor import Supervisor


def test_one_bundle_per_stage_with_stage_0_pinned_to_this_node():
    settings = RaySettings(stage_resources=[{"CPU": 4, "memory": 8e9}])
    bundles = settings.bundles(3, "10.0.0.1")
    assert bundles == [{"CPU": 4, "memory": 8e9, "node:10.0.0.1": 0.001}, {"CPU": 4, "memory": 8e9},
                       {"CPU": 4, "memory": 8e9}]
    assert settings.stage_resources == [{"CPU": 4, "memory": 8e9}]  # the settings' own bundle is untouched
    assert settings.strategy == "STRICT_SPREAD"
    assert RaySettings(placement="pack").strategy == "PACK"
    assert split_weights(bundles) is None  # alike: an even split


def test_the_split_follows_the_bundles_cpus():
    settings = RaySettings(stage_resources=[{"CPU": 2}, {"CPU": 6}, {"CPU": 4}])
    assert split_weights(settings.bundles(3, "10.0.0.1")) == [2, 6, 4]


def test_the_cli_builds_the_ray_settings_and_checks_them():
    args = build_parser().parse_args(["serve", "--ray", "10.0.0.1:6379", "--stages", "3", "--ray-placement", "pack",
                                      "--ray-stage-resources", '{"CPU": 8}', "--ray-port", "7300",
                                      "--weights", "1,2,1", "--ray-no-standby"])
    config = serve_config(args, ray=ray_settings(args))
    assert config.ray == RaySettings(address="10.0.0.1:6379", placement="pack", stage_resources=[{"CPU": 8}],
                                     port=7300, standby=False)
    assert config.weights == [1, 2, 1]
    assert ray_settings(build_parser().parse_args(["serve"])) is None
    with pytest.raises(ValueError, match="--ray with --stages N"):
        serve_config(args, ray=ray_settings(args), num_stages=1)
    with pytest.raises(ValueError, match="one --ray-stage-resources bundle or 3"):
        serve_config(args, ray=RaySettings(stage_resources=[{"CPU": 1}, {"CPU": 2}]))
    assert serve_config(args, ray=ray_settings(args), split="auto").split == "auto"  # measured on the placed nodes
    with pytest.raises(ValueError, match="3 --weights"):
        serve_config(args, ray=ray_settings(args), weights=[1, 1])
    with pytest.raises(ValueError, match="stage resources"):
        RaySettings(stage_resources=[{}])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--ray", "auto", "--ray-stage-resources", "{CPU: 8}"])


def test_a_cluster_without_token_auth_off_loopback_is_refused(caplog):
    asked = []

    def enforced(answer):
        return lambda: asked.append(answer) or answer

    check_cluster_security(["127.0.0.1"], enforced(False), insecure=False, address="auto")
    assert asked == []  # loopback only: nothing to ask
    check_cluster_security(["10.0.0.1", "10.0.0.2"], enforced(True), insecure=False, address="10.0.0.1:6379")
    with pytest.raises(ValueError, match="without token authentication") as refused:
        check_cluster_security(["10.0.0.1", "127.0.0.1"], enforced(False), insecure=False, address="10.0.0.1:6379")
    assert "RAY_AUTH_MODE=token" in str(refused.value) and "--insecure" in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="skippy.launch"):
        check_cluster_security(["10.0.0.1"], enforced(False), insecure=True, address="10.0.0.1:6379")
    assert "(--insecure)" in caplog.text


class FakePlacement:
    """Stage 1 goes down `failures` times; each restart lands on the next of `hosts`."""

    def __init__(self, hosts: list[str], failures: int):
        self.hosts, self.failures = hosts, failures
        self.at = ["10.0.0.1", hosts[0]]
        self.down, self.gave_up = asyncio.Event(), []
        self.restarts = 0

    def endpoint(self, index):
        return f"{self.at[index]}:{7200 + index}"

    def node_ip(self, index):
        return self.at[index]

    async def wait_down(self, index):
        if self.restarts < self.failures:
            return "its Ray actor died (its node died)"
        await asyncio.Event().wait()  # up for good

    async def kill(self, index):
        pass

    async def restart(self, index):
        self.restarts += 1
        self.at[index] = self.hosts[self.restarts % len(self.hosts)]
        return self.endpoint(index)

    async def give_up(self, index):
        self.gave_up.append(index)


def test_a_stage_that_comes_back_elsewhere_counts_a_move():
    async def main():
        placement = FakePlacement(["10.0.0.2", "10.0.0.5"], failures=1)
        supervisor = Supervisor(placement, 2, None, backoff_s=0, probe_interval_s=30)
        supervisor.start()
        await asyncio.sleep(0.1)
        await supervisor.close()
        return supervisor.health[1]

    health = asyncio.run(main())
    assert (health.state, health.restarts, health.moves) == ("ready", 1, 1)
    assert (health.endpoint, health.node_ip) == ("10.0.0.5:7201", "10.0.0.5")
    assert health.last_failure == "its Ray actor died (its node died)"


def test_past_its_budget_the_placement_is_told_to_give_up():
    async def main():
        placement = FakePlacement(["10.0.0.2"], failures=10)
        supervisor = Supervisor(placement, 2, None, max_restarts=2, backoff_s=0, probe_interval_s=30)
        supervisor.start()
        await asyncio.sleep(0.1)
        await supervisor.close()
        return supervisor, placement

    supervisor, placement = asyncio.run(main())
    assert (supervisor.health[1].state, supervisor.health[1].restarts) == ("failed", 2)
    assert supervisor.health[1].moves == 0  # the same node every time
    assert placement.gave_up == [1] and not supervisor.can_heal()


def test_without_ray_serve_ray_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(RuntimeError, match=r"needs Ray .* pip install 'skippy\[ray\]'"):
        asyncio.run(RayChain(bundled_model_path(), 3, RaySettings()).start())
