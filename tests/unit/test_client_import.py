"""A client process imports ``onceq`` without the broker's modules; the broker's names are
still there when asked for."""

from __future__ import annotations

import subprocess
import sys


def test_import_onceq_loads_no_broker_module_until_asked() -> None:
    code = ("import sys, onceq\n"
            "before = sorted(m for m in sys.modules if m.startswith(('onceq.broker', "
            "'onceq.storage', 'onceq.cluster', 'onceq.rocketmq')))\n"
            "from onceq import Broker, BrokerConfig, StoreConfig\n"
            "print(before, Broker.__module__, BrokerConfig.__module__, StoreConfig.__module__)\n"
            "try:\n    onceq.NoSuchName\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["[] onceq.broker.broker onceq.broker.config onceq.storage.config",
                   "module 'onceq' has no attribute 'NoSuchName'"]
