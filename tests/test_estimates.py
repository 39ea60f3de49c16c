"""
Learned wake estimates (L{nvproxy.vllm._estimates}): convergence over
scripted wake latencies on a Clock, persistence across a restart, and their
use in the depth-aware 503 and the readiness of a service.
"""

from __future__ import annotations

import json
import math
import os

from prometheus_client import generate_latest
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.config import VllmHold
from nvproxy.vllm import Depth, VllmManager, Waking
from nvproxy.vllm._estimates import ESTIMATES_FILE, WakeEstimates
from tests.test_vllm import _Harness


class WakeEstimatesTests(SynchronousTestCase):
    def test_seeded_from_fd(self) -> None:
        estimates = WakeEstimates(["text"], None)
        self.assertEqual(
            [estimates.estimate("text", d) for d in Depth], [6.0, 45.0, 300.0]
        )
        self.assertEqual(estimates.samples("text", Depth.SLEEPING), 0)

    def test_converges(self) -> None:
        estimates = WakeEstimates(["text"], None)
        for _ in range(20):
            estimates.observe("text", Depth.SLEEPING, 20.0)
        self.assertLess(abs(estimates.estimate("text", Depth.SLEEPING) - 20.0), 0.02)
        self.assertEqual(estimates.samples("text", Depth.SLEEPING), 20)
        # the other depths are untouched
        self.assertEqual(estimates.estimate("text", Depth.OFFLOADED), 45.0)

    def test_ignores_nonsense(self) -> None:
        estimates = WakeEstimates(["text"], None)
        estimates.observe("text", Depth.SLEEPING, math.nan)
        estimates.observe("text", Depth.SLEEPING, -1.0)
        self.assertEqual(estimates.estimate("text", Depth.SLEEPING), 6.0)

    def test_persisted(self) -> None:
        state_dir = self.mktemp()
        os.makedirs(state_dir)
        estimates = WakeEstimates(["text"], state_dir)
        estimates.observe("text", Depth.OFFLOADED, 15.0)
        again = WakeEstimates(["text"], state_dir)
        self.assertEqual(again.estimate("text", Depth.OFFLOADED), 36.0)
        self.assertEqual(again.samples("text", Depth.OFFLOADED), 1)
        # a service no longer configured is forgotten
        self.assertEqual(WakeEstimates(["other"], state_dir).all()[1][2], 45.0)

    def test_unreadable_file_is_ignored(self) -> None:
        state_dir = self.mktemp()
        os.makedirs(state_dir)
        for content in (
            b"not json",
            b'{"version": 2, "services": {}}',
            b'{"version": 1, "services": {"text": {"sleeping": {"estimate": -3}}}}',
            b'{"version": 1, "services": {"text": {"deep": {"estimate": 3}}}}',
        ):
            with open(os.path.join(state_dir, ESTIMATES_FILE), "wb") as f:
                f.write(content)
            estimates = WakeEstimates(["text"], state_dir)
            self.assertEqual(estimates.estimate("text", Depth.SLEEPING), 6.0)
        self.flushLoggedErrors()


class LearnedWakeTests(_Harness):
    def wake(self, manager: VllmManager, latency: float) -> None:
        """Sleep C{text} at level 1 and wake it with C{latency}."""
        self.successResultOf(manager.sleep("text", 1))
        self.fakes["text"].wake_latency = latency
        self.successResultOf(self._wait(manager))

    def _wait(self, manager: VllmManager) -> object:
        d = manager.wake("text")
        self.advance(self.fakes["text"].wake_latency + 2)
        return d

    def test_converges_over_scripted_wakes(self) -> None:
        """
        Every wake is measured from the wake call to the first healthy
        answer; the estimate follows the scripted latencies.
        """
        manager = self.manager()
        self.serve(manager)
        for latency in (12.0, 12.0, 12.0, 12.0, 12.0, 12.0, 12.0, 12.0):
            self.wake(manager, latency)
        estimate = manager.estimates.estimate("text", Depth.SLEEPING)
        self.assertLess(abs(estimate - 12.0), 0.6, estimate)
        self.successResultOf(manager.sleep("text", 1))
        readiness = manager.readiness("text")
        self.assertEqual(readiness.readiness, "sleeping")
        self.assertEqual(readiness.wake_estimate_s, estimate)
        exposition = generate_latest(self.metrics).decode()
        self.assertIn(
            'nvproxy_vllm_wake_duration_seconds_count{depth="sleeping",service="text"}'
            " 8.0",
            exposition,
        )
        self.assertIn(
            'nvproxy_vllm_wake_estimate_seconds{depth="sleeping",service="text"}',
            exposition,
        )
        status = {s["name"]: s for s in manager.status()}["text"]
        self.assertEqual(status["wake_estimates"]["sleeping"], round(estimate, 3))
        self.assertEqual(status["readiness"], "sleeping")

    def test_persists_across_restart(self) -> None:
        manager = self.manager()
        self.serve(manager)
        self.wake(manager, 30.0)
        learned = manager.estimates.estimate("text", Depth.SLEEPING)
        self.assertAlmostEqual(learned, 6 + 0.3 * 24, 1)
        manager.stopService()
        self.pump()
        again = self.manager()
        self.assertEqual(again.estimates.estimate("text", Depth.SLEEPING), learned)
        with open(os.path.join(self.state_dir, ESTIMATES_FILE)) as f:
            saved = json.load(f)
        self.assertEqual(saved["services"]["text"]["sleeping"]["samples"], 1)

    def test_503_carries_the_estimate(self) -> None:
        """
        C{estimated_wake_seconds} is the learned estimate less the time the
        wake took so far; C{Retry-After} stays by depth (FD §6.2.1).
        """
        manager = self.manager(hold=VllmHold(sleeping=1))
        self.serve(manager)
        self.wake(manager, 30.0)  # estimate 13.2
        self.successResultOf(manager.sleep("text", 1))
        d = manager.ensure_awake("text")
        self.advance(1)
        error = self.failureResultOf(d, Waking).value
        assert isinstance(error, Waking)
        self.assertEqual(error.estimated_wake_seconds, 13)  # 12.2 left
        self.assertEqual(error.retry_after, 10)
        self.advance(31)

    def test_retry_after_estimate(self) -> None:
        """With C{retry_after = "estimate"}: the estimate rounded up, >= 1."""
        manager = self.manager(hold=VllmHold(sleeping=1), retry_after_estimate=True)
        self.serve(manager)
        self.wake(manager, 30.0)
        self.successResultOf(manager.sleep("text", 1))
        d = manager.ensure_awake("text")
        self.advance(1)
        error = self.failureResultOf(d, Waking).value
        assert isinstance(error, Waking)
        self.assertEqual(error.retry_after, 13)
        self.advance(31)


class RetryAfterConfigTests(SynchronousTestCase):
    def load(self, value: str) -> object:
        from nvproxy.config import load_config

        path = self.mktemp()
        with open(path, "w") as f:
            f.write(f"[engines.vllm]\nretry_after = {value}\n")
        return load_config(path, {}, {"HOME": self.mktemp()})

    def test_values(self) -> None:
        from nvproxy.config import Config

        for value, expected in (('"estimate"', "estimate"), ('"depth"', "depth")):
            config = self.load(value)
            assert isinstance(config, Config)
            self.assertEqual(config.engines["vllm"].retry_after, expected)

    def test_bad_value_names_the_key(self) -> None:
        from nvproxy.config import ConfigError

        with self.assertRaises(ConfigError) as caught:
            self.load('"soon"')
        self.assertIn("engines.vllm.retry_after", str(caught.exception))
