"""pytest plugin for bench/suite_ab.sh: append every test phase's duration to the JSONL file
$SUITE_TIMING_OUT as it finishes (so a run cut short still has its numbers), with the run's
start and end times. Load it with ``-p suite_timing`` and bench/ on PYTHONPATH."""

import json
import os
import time

_F = None


def pytest_configure(config):
    global _F
    _F = open(os.environ["SUITE_TIMING_OUT"], "a", buffering=1)
    _F.write(json.dumps({"start": time.time()}) + "\n")


def pytest_runtest_logreport(report):
    _F.write(json.dumps({"id": report.nodeid, "when": report.when, "s": round(report.duration, 3),
                         "outcome": report.outcome, "t": time.time()}) + "\n")


def pytest_unconfigure(config):
    _F.write(json.dumps({"end": time.time()}) + "\n")
    _F.close()
